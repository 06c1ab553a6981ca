"""TorchEngine: batched sampling with a transformers model and its KV cache (CPU or one GPU).

All prompts x n samples are decoded in one loop. Prompts are left padded (position ids follow the
attention mask) and prefilled once each; the cache and last logits are then repeated n times. Each
step samples from the tempered distribution restricted to the nucleus `top_p`, but reports the
sampled token's log-prob under the full tempered distribution `log_softmax(logits / temperature)`,
which is what `workers.training.logprobs.token_logprobs` computes teacher-forced. A row stops at eos (kept in
its tokens), at a stop string (`SamplingSettings.stop`, matched on the text of its last tokens; kept too) or at
`max_new_tokens`; finished rows ride along until every row is done.

A multimodal directory (one with a processor config, e.g. `tiny-omni`) loads through `workers.omni.loading`
and also serves media prompts (`MediaEngine`): each is prefilled on its own with its processor tensors and
3-D rotary positions, then decoded like text. For such a model the media special tokens are masked to -inf
before sampling, text prompts included, and the log-probs are under that masked distribution (what
`workers.omni.logprobs.media_token_logprobs` computes teacher-forced). A text model masks nothing.

`record_routing` (R3, text MoE models): every router's choice is recorded during prefill and decoding
(`workers.moe.routing`), and each completion carries the experts of the tokens the model was fed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import torch

from relax_bus.log import get_logger
from workers.config.trainer_sections import LoraConfig
from workers.data.models import load_model, load_tokenizer
from workers.engines.base import Generated, MediaInputs, SamplingSettings, check_call, check_media, log_generated
from workers.engines.token_draw import draw
from workers.engines.torch_turns import TurnBatch
from workers.moe.routing import id_dtype, recording, routing_shape
from workers.omni.loading import is_multimodal, load_omni
from workers.omni.logprobs import mask_tokens, media_tensors, media_token_ids, rope_positions
from workers.weights.adapter import apply_adapter, in_model, inject, is_adapter, split

log = get_logger(__name__)


class TorchEngine:
    """A generation engine running a Hugging Face causal LM with plain torch."""

    name = "torch"

    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        record_routing: bool = False,
        lora: LoraConfig | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.processor: Any = None
        self.suppressed: torch.Tensor | None = None
        if is_multimodal(model_dir):
            model, self.processor = load_omni(model_dir, dtype=dtype)
            self.model = model.to(self.device)
            self.tokenizer = self.processor.tokenizer
            ids = media_token_ids(self.model.config)
            self.suppressed = torch.tensor(ids, dtype=torch.long, device=self.device) if ids else None
            text_config = self.model.config.get_text_config()
        else:
            self.model = load_model(model_dir, dtype=dtype).to(self.device)
            self.tokenizer = load_tokenizer(model_dir)
            text_config = self.model.config
        self.record_routing = record_routing
        if record_routing:
            if self.processor is not None:
                raise ValueError("the torch engine records routed experts (R3) for text models only, not multimodal")
            routing_shape(self.model)  # ValueError for a dense model
        self.version = 0
        self.adapter: LoraConfig | None = None
        """The run's LoRA adapter when it serves a `trainer.lora` run (`use_adapter`); None: whole versions."""
        self.max_context: int | None = getattr(text_config, "max_position_embeddings", None)
        self._tokens = 0
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not eos_ids:
            raise ValueError(f"model in {model_dir} names no eos token")
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.long, device=self.device)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else eos_ids[0]
        if lora is not None:
            self.use_adapter(lora)

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingSettings,
        seeds: list[int] | None = None,
        media: list[MediaInputs | None] | None = None,
    ) -> list[list[Generated]]:
        """Sample n completions for each prompt (token ids, bos included): one inner list per prompt.

        With `seeds`, row j of prompt i draws from its own generator seeded `seeds[i] + j`; otherwise one
        generator (seeded by `sampling.seed`, or the global one) serves the whole batch. `media[i]` holds
        the processor tensors of prompt i (None for text); a call with media needs a multimodal model.
        """
        check_call(prompts, n, seeds)
        if not prompts:
            return []
        if media is not None:
            check_media(prompts, media)
            if self.processor is None:
                raise ValueError("media prompts need a multimodal model (a directory with a processor config)")
        started = time.perf_counter()
        generator: torch.Generator | list[torch.Generator] | None = None
        if seeds is not None:
            generator = [torch.Generator(device=self.device).manual_seed(s + j) for s in seeds for j in range(n)]
        elif sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        routing: list[torch.Tensor] | None = None
        with torch.inference_mode():
            if self.processor is None and self.record_routing:
                with recording(self.model) as recorder:
                    tokens, logps, lengths = self._sample(prompts, n, sampling, generator)
                routing = _routes(recorder.calls, prompts, n, lengths, routing_shape(self.model)[2])
            elif self.processor is None:
                tokens, logps, lengths = self._sample(prompts, n, sampling, generator)
            else:  # a multimodal model: 3-D positions, media tokens masked, even for text prompts
                each = media if media is not None else [None] * len(prompts)
                tokens, logps, lengths = self._sample_each(prompts, each, n, sampling, generator)
        eos = set(self.eos_ids.tolist())
        out: list[list[Generated]] = [[] for _ in prompts]
        for row, (toks, lps, length) in enumerate(zip(tokens.tolist(), logps.tolist(), lengths.tolist(), strict=True)):
            toks, lps = toks[:length], lps[:length]
            text = str(self.tokenizer.decode(toks, skip_special_tokens=True))
            stopped = toks[-1] in eos or any(s in text for s in sampling.stop)
            out[row // n].append(
                Generated(
                    token_ids=toks,
                    logprobs=lps,
                    text=text,
                    finish_reason="stop" if stopped else "length",
                    routing=None if routing is None else routing[row],
                )
            )
        new_tokens = int(lengths.sum())
        self._tokens += new_tokens
        log_generated(prompts, n, new_tokens, started, self.version)
        return out

    def open_turns(self, contexts: list[list[int]]) -> TurnBatch:
        """One KV cache for the turns of a batch of text episodes (`workers.engines.torch_turns`)."""
        if self.processor is not None or self.record_routing:
            raise ValueError("multi-turn episodes on one cache need a text model without routing replay")
        return TurnBatch(self, contexts)

    def use_adapter(self, lora: LoraConfig) -> None:
        """Serve a LoRA run (`trainer.lora`): inject the run's adapter into the model once (peft, zero-initialised
        B, no dropout at inference); from then on `load_state_dict` takes adapter-only versions and copies them in
        place, without rebuilding the model."""
        inject(self.model, lora)
        self.model.eval()
        self.adapter = lora

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy new weights into the model in place and record their policy version. With an adapter
        (`use_adapter`) `state` is a LoRA version: the adapter's tensors, with or without the base's."""
        if self.adapter is None:
            self._load_whole(state)
        else:
            base, adapter = split(state)
            if base:
                self._load_whole(in_model(base, self.model), skip=is_adapter)
            apply_adapter(self.model, adapter)
        self.version = version
        log.info("weights_loaded", engine=self.name, version=version, tensors=len(state))

    def _load_whole(self, state: dict[str, torch.Tensor], skip: Callable[[str], bool] = lambda _: False) -> None:
        """Copy a state that names every tensor of the model (but those `skip` names) into it, in place."""
        own = {k: v for k, v in self.model.state_dict().items() if not skip(k)}
        aliases: dict[int, set[str]] = {}
        for key, tensor in own.items():
            aliases.setdefault(tensor.data_ptr(), set()).add(key)
        unexpected = sorted(state.keys() - own.keys())
        # A tied weight (lm_head = embed_tokens) may arrive under either of its names.
        missing = sorted(k for k in own.keys() - state.keys() if not aliases[own[k].data_ptr()] & state.keys())
        if missing or unexpected:
            raise ValueError(f"state dict does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.model.load_state_dict(state, strict=False)

    def tokens_generated(self) -> int:
        """Running count of tokens sampled since the engine started (eos included)."""
        return self._tokens

    def _sample(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingSettings,
        generator: torch.Generator | list[torch.Generator] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode every prompt n times: tokens [B, S] long, log-probs [B, S] float32, lengths [B], B = prompts*n."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=self.device)  # [P, W]
        mask = torch.zeros_like(ids)  # [P, W]
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long, device=self.device)
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [P, W]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        logits = out.logits[:, -1].float()  # [P, V]
        next_pos = positions[:, -1] + 1  # [P]
        return self._decode(cache, logits, mask, next_pos, n, sampling, generator)

    def _decode(
        self,
        cache: Any,
        logits: torch.Tensor,
        mask: torch.Tensor,
        next_pos: torch.Tensor,
        n: int,
        sampling: SamplingSettings,
        generator: torch.Generator | list[torch.Generator] | None,
        mrope: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample after prefilled prompts (cache, last logits [P, V], mask [P, W], next position [P]), n rows each.

        `mrope`: feed the 3-D rotary position [3, B, 1] (all three equal) instead of the 1-D one [B, 1].
        """
        logits = self._masked(logits)
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits, mask, next_pos = (t.repeat_interleave(n, dim=0) for t in (logits, mask, next_pos))
        batch, steps = logits.shape[0], sampling.max_new_tokens
        tokens = torch.full((batch, steps), self.pad_id, dtype=torch.long, device=self.device)  # [B, S]
        logps = torch.zeros(batch, steps, dtype=torch.float32, device=self.device)  # [B, S]
        lengths = torch.zeros(batch, dtype=torch.long, device=self.device)  # [B]
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)  # [B]
        for step in range(steps):
            logp = torch.log_softmax(logits / sampling.temperature, dim=-1)  # [B, V]
            tok = draw(logp, sampling.top_p, generator)  # [B]
            tokens[:, step] = tok
            logps[:, step] = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            lengths += (~done).long()
            done |= torch.isin(tok, self.eos_ids)
            if sampling.stop:
                done |= self._at_stop(tokens, step, done, sampling.stop)
            if bool(done.all()) or step == steps - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)  # [B, W + step + 1]
            position = next_pos.view(1, -1, 1).expand(3, -1, 1) if mrope else next_pos.unsqueeze(-1)
            out = self.model(
                input_ids=tok.unsqueeze(-1),
                attention_mask=mask,
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = self._masked(out.logits[:, -1].float())  # [B, V]
            next_pos = next_pos + 1
        return tokens, logps, lengths

    def _at_stop(self, tokens: torch.Tensor, step: int, done: torch.Tensor, stop: tuple[str, ...]) -> torch.Tensor:
        """[B] bool: the rows not yet done whose last tokens (`tokens` [B, S] up to `step`) now hold a stop string.
        A token holds at least one character, so the last `len(stop)` tokens hold any stop string just completed."""
        window = max(len(s) for s in stop)
        hit = torch.zeros_like(done)
        for row in (~done).nonzero().flatten().tolist():
            tail = self.tokenizer.decode(tokens[row, max(0, step + 1 - window) : step + 1].tolist())
            hit[row] = any(s in tail for s in stop)
        return hit

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] with the media special tokens at -inf (unchanged for a text model)."""
        return mask_tokens(logits, self.suppressed)

    def _sample_each(
        self,
        prompts: list[list[int]],
        media: list[MediaInputs | None],
        n: int,
        sampling: SamplingSettings,
        generator: torch.Generator | list[torch.Generator] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill and decode each prompt on its own with its media: tokens [B, S], log-probs [B, S], lengths [B]."""
        steps = sampling.max_new_tokens
        rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for i, (prompt, inputs) in enumerate(zip(prompts, media, strict=True)):
            own = generator[i * n : (i + 1) * n] if isinstance(generator, list) else generator
            if inputs is None:
                inputs = {"input_ids": torch.tensor([prompt], dtype=torch.long)}
            inputs = {k: v.to(self.device) for k, v in inputs.items()}
            ids = inputs["input_ids"]  # [1, W]
            mask = inputs.get("attention_mask", torch.ones_like(ids))  # [1, W]
            extra = media_tensors(inputs)
            positions = rope_positions(self.model, ids, mask, extra)  # [3, 1, W]
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **extra)
            next_pos = positions[:, :, -1].max(0).values + 1  # [1]
            toks, lps, lens = self._decode(
                out.past_key_values, out.logits[:, -1].float(), mask, next_pos, n, sampling, own, mrope=True
            )
            width = toks.shape[1]
            if width < steps:  # a prompt whose rows all stopped early: pad to the common width
                toks = torch.nn.functional.pad(toks, (0, steps - width), value=self.pad_id)
                lps = torch.nn.functional.pad(lps, (0, steps - width))
            rows.append((toks, lps, lens))
        return tuple(torch.cat(parts) for parts in zip(*rows, strict=True))  # type: ignore[return-value]


def _routes(
    calls: list[torch.Tensor], prompts: list[list[int]], n: int, lengths: torch.Tensor, experts: int
) -> list[numpy.ndarray]:
    """Each row's routing from a recorded `_sample`: [prompt + length - 1, layers, k] per row (B = prompts x n).

    `calls[0]` is the left-padded prefill [P x W, layers, k]; `calls[1 + s]` is decode step s [B, layers, k], which
    fed response token s. A row's last token was never fed back, so it has no routing. The rows are numpy views of
    one [B, W + S - 1, layers, k] tensor, converted to the wire's integer type once.
    """
    width = max(len(p) for p in prompts)
    dtype = id_dtype(experts)
    prefill = calls[0].to(dtype).view(len(prompts), width, *calls[0].shape[1:])  # [P, W, layers, k]
    rows = prefill.repeat_interleave(n, dim=0)  # [B, W, layers, k]
    if len(calls) > 1:
        rows = torch.cat([rows, torch.stack(calls[1:], dim=1).to(dtype)], dim=1)  # [B, W + S - 1, layers, k]
    arr = rows.cpu().numpy()
    return [arr[r, width - len(prompts[r // n]) : width + length - 1] for r, length in enumerate(lengths.tolist())]

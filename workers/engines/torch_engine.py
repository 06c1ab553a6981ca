"""TorchEngine: batched sampling with a transformers model and its KV cache (CPU or one GPU).

All prompts x n samples are decoded in one loop. Prompts are left padded (position ids follow the
attention mask) and prefilled once each; the cache and last logits are then repeated n times. Each
step samples from the tempered distribution restricted to the nucleus `top_p`, but reports the
sampled token's log-prob under the full tempered distribution `log_softmax(logits / temperature)`,
which is what `workers.logprobs.token_logprobs` computes teacher-forced. A row stops at eos (kept in
its tokens) or at `max_new_tokens`; finished rows ride along until every row is done.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from relax_bus.log import get_logger
from workers.engines.base import Generated, SamplingSettings, log_generated
from workers.models import load_model, load_tokenizer

log = get_logger(__name__)


class TorchEngine:
    """A generation engine running a Hugging Face causal LM with plain torch."""

    name = "torch"

    def __init__(self, model_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.device = torch.device(device)
        self.model = load_model(model_dir, dtype=dtype).to(self.device)
        self.tokenizer = load_tokenizer(model_dir)
        self.version = 0
        self.max_context: int | None = getattr(self.model.config, "max_position_embeddings", None)
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

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingSettings) -> list[list[Generated]]:
        """Sample n completions for each prompt (token ids, bos included): one inner list per prompt."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token (the bos)")
        if not prompts:
            return []
        started = time.perf_counter()
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        with torch.inference_mode():
            tokens, logps, lengths = self._sample(prompts, n, sampling, generator)
        eos = set(self.eos_ids.tolist())
        out: list[list[Generated]] = [[] for _ in prompts]
        for row, (toks, lps, length) in enumerate(zip(tokens.tolist(), logps.tolist(), lengths.tolist(), strict=True)):
            toks, lps = toks[:length], lps[:length]
            out[row // n].append(
                Generated(
                    token_ids=toks,
                    logprobs=lps,
                    text=str(self.tokenizer.decode(toks, skip_special_tokens=True)),
                    finish_reason="stop" if toks[-1] in eos else "length",
                )
            )
        new_tokens = int(lengths.sum())
        self._tokens += new_tokens
        log_generated(prompts, n, new_tokens, started, self.version)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy new weights into the model in place and record their policy version."""
        own = self.model.state_dict()
        aliases: dict[int, set[str]] = {}
        for key, tensor in own.items():
            aliases.setdefault(tensor.data_ptr(), set()).add(key)
        unexpected = sorted(state.keys() - own.keys())
        # A tied weight (lm_head = embed_tokens) may arrive under either of its names.
        missing = sorted(k for k in own.keys() - state.keys() if not aliases[own[k].data_ptr()] & state.keys())
        if missing or unexpected:
            raise ValueError(f"state dict does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.model.load_state_dict(state, strict=False)
        self.version = version
        log.info("weights_loaded", engine=self.name, version=version, tensors=len(state))

    def tokens_generated(self) -> int:
        """Running count of tokens sampled since the engine started (eos included)."""
        return self._tokens

    def _sample(
        self, prompts: list[list[int]], n: int, sampling: SamplingSettings, generator: torch.Generator | None
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
            tok = _draw(logp, sampling.top_p, generator)  # [B]
            tokens[:, step] = tok
            logps[:, step] = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            lengths += (~done).long()
            done |= torch.isin(tok, self.eos_ids)
            if bool(done.all()) or step == steps - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)  # [B, W + step + 1]
            out = self.model(
                input_ids=tok.unsqueeze(-1),
                attention_mask=mask,
                position_ids=next_pos.unsqueeze(-1),
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1].float()  # [B, V]
            next_pos = next_pos + 1
        return tokens, logps, lengths


def _draw(logp: torch.Tensor, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Sample one token per row from exp(logp) [B, V], restricted to the smallest nucleus of mass >= top_p."""
    probs = logp.exp()  # [B, V]
    if top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [B, V]
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # mass before a token already reaches top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    pick = torch.multinomial(sorted_probs, 1, generator=generator)  # [B, 1]
    return order.gather(-1, pick).squeeze(-1)

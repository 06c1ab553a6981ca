"""The generation engine interface (what the rollout role calls) and the registry of engines.

An engine samples n completions per prompt and reports, for every sampled token, its log-prob under
the full tempered distribution `log_softmax(logits / temperature)` (not renormalised after top-p), so
that it equals `workers.logprobs.token_logprobs` on the same weights. Adding an engine is one module
plus one line in `ENGINES`; `make_engine` imports it only when asked for.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from relax_bus.log import get_logger

if TYPE_CHECKING:
    import torch

log = get_logger(__name__)

ENGINES: dict[str, str] = {
    "torch": "workers.engines.torch_engine:TorchEngine",
    "vllm": "workers.engines.vllm_engine:VllmEngine",
    "sim": "workers.engines.sim_engine:SimEngine",
}


def log_generated(prompts: list[list[int]], n: int, tokens: int, started: float, version: int) -> None:
    """The debug line every engine writes after a generate call (`started`: its perf_counter at the start)."""
    log.debug(
        "generated",
        prompts=len(prompts),
        n=n,
        tokens=tokens,
        seconds=round(time.perf_counter() - started, 4),
        version=version,
    )


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample: temperature, nucleus top_p, a cap on new tokens, and an optional seed."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int | None = None

    def __post_init__(self) -> None:
        """Reject settings no engine can honour."""
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class Generated:
    """One sampled completion: its tokens (eos included when it stopped), their log-probs, and its text."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: Literal["stop", "length"]


class Engine(Protocol):
    """A generation engine holding one policy version of the weights."""

    name: str
    version: int
    max_context: int | None
    """Most tokens (prompt plus response) one sequence may hold; None when the model sets no bound."""

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingSettings) -> list[list[Generated]]:
        """Sample n completions for each prompt (token ids, bos included): one inner list per prompt."""
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Replace the weights in place and record their policy version."""
        ...

    def tokens_generated(self) -> int:
        """Running count of tokens sampled since the engine started."""
        ...


def make_engine(kind: str, model_dir: Path, device: str = "cpu", **options: Any) -> Engine:
    """Create the engine registered under `kind` for the model in `model_dir` (`options` go to its constructor)."""
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; known engines: {', '.join(sorted(ENGINES))}")
    module_name, class_name = ENGINES[kind].split(":")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    engine: Engine = engine_class(model_dir=Path(model_dir), device=device, **options)
    return engine

"""The generation engine interface (what the rollout role calls) and the registry of engines.

An engine samples n completions per prompt and reports, for every sampled token, its log-prob under
the full tempered distribution `log_softmax(logits / temperature)` (not renormalised after top-p), so
that it equals `workers.training.logprobs.token_logprobs` on the same weights. Adding an engine is one module
plus one line in `ENGINES`; `make_engine` imports it only when asked for.

Media prompts (images, audio, video) take one extension, `MediaEngine`: `generate` gets, next to each
prompt's token ids, the processor's tensors for that prompt (`workers.omni.media.processor_inputs`), and the
prompt ids are the processor's `input_ids`, media tokens expanded. Only the torch engine implements it so far.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from relax_bus.log import get_logger
from workers.omni.inputs import MediaInputs

if TYPE_CHECKING:
    import numpy
    import torch

log = get_logger(__name__)

ENGINES: dict[str, str] = {
    "torch": "workers.engines.torch_engine:TorchEngine",
    "vllm": "workers.engines.vllm_engine:VllmEngine",
    "sim": "workers.engines.sim_engine:SimEngine",
}


def check_call(prompts: list[list[int]], n: int, seeds: list[int] | None) -> None:
    """Refuse a generate call no engine can serve (every engine checks its arguments the same way)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token (the bos)")
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one seed per prompt")


def check_media(prompts: list[list[int]], media: list[MediaInputs | None]) -> None:
    """Refuse media that does not line up with the prompts: one entry per prompt, its input_ids equal to the prompt."""
    if len(media) != len(prompts):
        raise ValueError(f"{len(media)} media entries for {len(prompts)} prompts: give one per prompt (None for text)")
    for row, (prompt, inputs) in enumerate(zip(prompts, media, strict=True)):
        if inputs is None:
            continue
        ids = inputs.get("input_ids")
        if ids is None or ids.dim() != 2 or ids.shape[0] != 1 or ids[0].tolist() != prompt:
            raise ValueError(f"prompt {row}: its media input_ids differ from the prompt ids (use the processor's ids)")


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
    """How to sample: temperature, nucleus top_p, a cap on new tokens, an optional seed, and stop strings."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """A row also stops once its text contains one of these (the tokens that completed it are kept, and its
    finish reason is `stop`): an agent's turn ends at its tool call's closing tag."""

    def __post_init__(self) -> None:
        """Reject settings no engine can honour."""
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")


@dataclass(frozen=True)
class Generated:
    """One sampled completion: its tokens (eos included when it stopped), their log-probs, its text, and (R3) the
    experts its tokens were routed to."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: Literal["stop", "length"]
    routing: numpy.ndarray | None = None
    """With routing recorded (R3): the experts of every token the model was fed, prompt then response but the
    last token, [prompt + tokens - 1, MoE layers, top_k] uint8 (int16 above 256 experts); None otherwise. A numpy
    view: one slice per row of the call's routing costs a tenth of a torch slice."""


class Engine(Protocol):
    """A generation engine holding one policy version of the weights."""

    name: str
    version: int
    max_context: int | None
    """Most tokens (prompt plus response) one sequence may hold; None when the model sets no bound."""

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingSettings, seeds: list[int] | None = None
    ) -> list[list[Generated]]:
        """Sample n completions for each prompt (token ids, bos included): one inner list per prompt.

        With `seeds` (one per prompt), sample j of prompt i is drawn from the random stream `seeds[i] + j`
        alone: it depends on that seed and the weights, not on the other prompts of the call.
        """
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Replace the weights in place and record their policy version."""
        ...

    def tokens_generated(self) -> int:
        """Running count of tokens sampled since the engine started."""
        ...


class MediaEngine(Engine, Protocol):
    """An engine that also samples after prompts carrying media (images, audio, video)."""

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingSettings,
        seeds: list[int] | None = None,
        media: list[MediaInputs | None] | None = None,
    ) -> list[list[Generated]]:
        """As `Engine.generate`; `media[i]` holds the processor tensors of prompt i (None for a text prompt).

        Media special tokens are never sampled, and each reported log-prob is under the tempered distribution
        with them masked to -inf (what `workers.omni.logprobs.media_token_logprobs` computes teacher-forced).
        """
        ...


def refuse_routing(engine: str, record_routing: bool, why: str) -> None:
    """Refuse to start an engine asked to record routed experts (R3) that cannot, with the reason in one line."""
    if record_routing:
        raise ValueError(f"the {engine} engine cannot record routed experts for R3 ({why}): use rollout.engine torch")


def make_engine(kind: str, model_dir: Path, device: str = "cpu", **options: Any) -> Engine:
    """Create the engine registered under `kind` for the model in `model_dir` (`options` go to its constructor;
    `record_routing=True` asks for the experts of every token, R3, which an engine that cannot refuses)."""
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; known engines: {', '.join(sorted(ENGINES))}")
    module_name, class_name = ENGINES[kind].split(":")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    engine: Engine = engine_class(model_dir=Path(model_dir), device=device, **options)
    return engine

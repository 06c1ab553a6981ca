"""How the trainer turns a micro-batch's rows into token log-probs: one strategy, chosen once when the trainer is
built (`forward_for`), so the step never asks which.

    plain          every row `prompt + response` forwarded on its own (`token_logprobs`)
    shared prompt  each distinct prompt forwarded once, its key/value cache reused for its group's responses
                   (`workers.training.shared_prompt`); micro-batches then hold whole groups
    media          a multimodal policy's rows with their groups' processor tensors (`workers.training.media_policy`)
    routed         any of the above under routing replay (`trainer.moe.routing_replay`;
                   `workers.training.routing_replay`)

Every strategy answers `logprobs(batch, rows, old) -> (mb, logp)`: the rows cut from the step's batch onto the
device (`mb`) and their log-probs [rows, width-1] (with grad when enabled; `old`: the no-grad pass before the
first update). The step's hooks (`begin_step`, `pass_done`, `metrics`, `problem`) are routing replay's; the
others leave them empty.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from schemas import TrainGroup
from workers.training.batch import Batch
from workers.training.logprobs import token_logprobs
from workers.training.media_policy import media_rows_logprobs
from workers.training.microbatch import pack, pack_groups
from workers.training.routing_replay import TrainerRouting
from workers.training.shared_prompt import grouped_logprobs, place

Autocast = Callable[[], Any]
"""The precision context of a forward pass (`workers.training.ranks`)."""


class PlainForward:
    """Each row forwarded on its own, right padded to the micro-batch's longest."""

    shares_prompt = False
    """Whether each distinct prompt is forwarded once per micro-batch (its rows then pack by group)."""

    def __init__(self, model: nn.Module, device: torch.device, temperature: float, autocast: Autocast) -> None:
        self.model = model
        self.device = device
        self.temperature = temperature
        self.autocast = autocast

    def pack(self, lengths: Sequence[int], group_of: Sequence[int], budget: int | None) -> list[list[int]]:
        """Micro-batches (indices into `lengths`) of at most `budget` padded tokens each."""
        return pack(lengths, budget)

    def logprobs(self, batch: Batch, rows: list[int], old: bool = False) -> tuple[Batch, torch.Tensor]:
        """The rows on the device and their token log-probs [rows, width-1]."""
        mb = batch.rows(rows, self.device)
        return mb, self.rows_logprobs(mb)

    def rows_logprobs(self, mb: Batch) -> torch.Tensor:
        with self.autocast():
            return token_logprobs(self.model, mb.ids, mb.attention, self.temperature)

    def begin_step(self) -> None:
        """A new step begins."""

    def pass_done(self) -> None:
        """A pass over a mini-batch (the old-policy pass, or an update) is done."""

    def metrics(self) -> dict[str, float]:
        """The step's metrics of this forward (none)."""
        return {}

    def problem(self, group: TrainGroup) -> str | None:
        """Why this forward cannot take `group` (never)."""
        return None


class SharedPromptForward(PlainForward):
    """Each distinct prompt of a micro-batch forwarded once, its key/value cache reused for its group's responses."""

    shares_prompt = True

    def pack(self, lengths: Sequence[int], group_of: Sequence[int], budget: int | None) -> list[list[int]]:
        """Micro-batches of whole groups, at most `budget` padded tokens each where a group fits."""
        return pack_groups(lengths, group_of, budget)

    def rows_logprobs(self, mb: Batch) -> torch.Tensor:
        with self.autocast():
            first: dict[int, int] = {}  # group -> its first row here: the distinct prompts, in order
            for i, g in enumerate(mb.group_of):
                first.setdefault(g, i)
            slot = {g: s for s, g in enumerate(first)}
            ids = mb.ids.tolist()
            prompts = [ids[i][: mb.prompt_lengths[i]] for i in first.values()]
            responses = [ids[i][p:n] for i, (p, n) in enumerate(zip(mb.prompt_lengths, mb.lengths, strict=True))]
            logps = grouped_logprobs(self.model, prompts, responses, [slot[g] for g in mb.group_of], self.temperature)
        return place(logps, mb.prompt_lengths, mb.ids.shape[1])


class MediaForward(PlainForward):
    """A multimodal policy: each group's prompt embedded once with its processor tensors (`workers.omni`)."""

    def rows_logprobs(self, mb: Batch) -> torch.Tensor:
        with self.autocast():
            rows = (mb.ids, mb.attention, mb.media, mb.group_of)
            return media_rows_logprobs(self.model, *rows, self.temperature, mb.prompt_lengths)


class RoutedForward:
    """Another forward under routing replay: every pass forced to the rollout's experts (r3) or to the trainer's own
    routing recorded in the old-policy pass (r2), with the step's routing metrics."""

    def __init__(self, inner: PlainForward, routing: TrainerRouting) -> None:
        self.inner = inner
        self.routing = routing
        self.shares_prompt = inner.shares_prompt

    def pack(self, lengths: Sequence[int], group_of: Sequence[int], budget: int | None) -> list[list[int]]:
        return self.inner.pack(lengths, group_of, budget)

    def logprobs(self, batch: Batch, rows: list[int], old: bool = False) -> tuple[Batch, torch.Tensor]:
        """The inner forward's, under replay (or, r2's old pass, recording); measured in the step's first pass."""
        inner = self.inner
        with self.routing.forward(inner.model, batch, rows, self.shares_prompt, old) as replayer:
            mb, logp = inner.logprobs(batch, rows, old)
        with inner.autocast():
            self.routing.measure(inner.model, mb, logp, replayer, inner.temperature)
        return mb, logp

    def begin_step(self) -> None:
        """Forget r2's routing; measure in the step's first pass."""
        self.routing.begin_step()

    def pass_done(self) -> None:
        """The step's routing metrics are taken after its first pass."""
        self.routing.measured()

    def metrics(self) -> dict[str, float]:
        return self.routing.metrics()

    def problem(self, group: TrainGroup) -> str | None:
        """Why `group` cannot be replayed (r3: a sample without the rollout's routing), or None."""
        return self.routing.problem(group)


Forward = PlainForward | RoutedForward
"""Any of the trainer's forwards."""


def forward_for(
    model: nn.Module,
    device: torch.device,
    temperature: float,
    autocast: Autocast,
    *,
    media: bool,
    shared_prompt: bool,
    routing: TrainerRouting | None,
) -> Forward:
    """The forward of a trainer: media for a multimodal policy, else shared-prompt or plain; routed when `routing`."""
    kind = MediaForward if media else SharedPromptForward if shared_prompt else PlainForward
    forward = kind(model, device, temperature, autocast)
    return forward if routing is None else RoutedForward(forward, routing)

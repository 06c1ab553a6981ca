"""Routing replay in the trainer (`trainer.moe.routing_replay`; docs/r3.md): which experts each training forward is
forced to use, laid out as the forward lays out its tokens, and the per-step routing metrics.

A row's routing is [S, layers, k] with S = prompt + response - 1 (the tokens the rollout engine fed its model).
The two forward layouts of `workers.training.logprobs` / `workers.training.shared_prompt` take it as:

    plain     one call, rows right padded [R, W]:      plan[i, :S_i]              = routing_i
    grouped   call 1, distinct prompts left padded [G, P]: plan[g, P - p_g:]      = routing_first(g)[:p_g]
              call 2, responses but their last [R, M-1]:   plan[i, :r_i - 1]      = routing_i[p_i : p_i + r_i - 1]

and -1 everywhere else (padding, each row's last token), where the router keeps its own choice. `r3` replays
the rollout's routing in every forward of the step; `r2` records the trainer's own routing in the no-grad pass
before the first update (which exists only with mini_batches x ppo_epochs > 1) and replays it in the updates.

Metrics, from the step's first forward of each row (weights = the old policy: the pass before the first update, or
else the first update), `r3` only:
    routing_agreement          forced (token, layer) choices the trainer's router would have made itself
    routing_mismatch_replay    mean |logp_trainer - logp_rollout| over response tokens, with replay (and _max)
    routing_mismatch_free      the same without replay, on `routing_metrics_fraction` of each micro-batch's rows
                               (absent when that fraction is 0)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from schemas import TrainGroup
from workers.moe.routing import RoutingReplayer, recording, replaying, routing_shape
from workers.training.batch import routed_experts
from workers.training.logprobs import token_logprobs

if TYPE_CHECKING:
    from workers.training.batch import Batch


def plain_plan(routes: Sequence[torch.Tensor], width: int, layers: int, k: int) -> torch.Tensor:
    """The plan of one right-padded forward of rows `routes[i]` ([S_i, layers, k]) at `width`: [R x W, layers, k]."""
    flat, base = _joined(routes)
    entries = [(i, 0, int(r.shape[0]), i, 0) for i, r in enumerate(routes)]
    return _placed(flat, base, entries, (len(routes), width, layers, k))


def grouped_plan(
    routes: Sequence[torch.Tensor], prompt_lengths: Sequence[int], response_lengths: Sequence[int], first: Sequence[int]
) -> list[torch.Tensor]:
    """The plans of the prompt-shared forward (`grouped_logprobs`): the distinct prompts' call (their first rows
    `first`, left padded), then the responses' call when some response has two tokens or more."""
    layers, k = routes[0].shape[1:]
    flat, base = _joined(routes)
    p_width = max(prompt_lengths[i] for i in first)
    entries = [(i, 0, prompt_lengths[i], g, p_width - prompt_lengths[i]) for g, i in enumerate(first)]
    plans = [_placed(flat, base, entries, (len(first), p_width, layers, k))]
    feed = max(response_lengths) - 1
    if feed > 0:
        fed = [(i, p, n - 1, i, 0) for i, (p, n) in enumerate(zip(prompt_lengths, response_lengths, strict=True))]
        plans.append(_placed(flat, base, fed, (len(routes), feed, layers, k)))
    return plans


def _joined(routes: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The rows' routing end to end ([sum S_i, layers, k]) and where each row starts in it."""
    starts, at = [], 0
    for r in routes:
        starts.append(at)
        at += int(r.shape[0])
    return torch.cat(list(routes)), starts


def _placed(
    flat: torch.Tensor, base: list[int], entries: list[tuple[int, int, int, int, int]], shape: tuple[int, ...]
) -> torch.Tensor:
    """A plan [rows x W, layers, k] of -1 with, for each entry (route, from, count, row, to), the route's tokens
    [from, from + count) copied to row `row` at [to, to + count): one gather and one scatter for the whole call."""
    rows, width, layers, k = shape
    plan = torch.full((rows * width, layers, k), -1, dtype=torch.long)
    counts = torch.tensor([e[2] for e in entries], dtype=torch.long)
    total = int(counts.sum())
    if total == 0:
        return plan
    entry = torch.repeat_interleave(torch.arange(len(entries)), counts)  # [total]: the entry of each copied token
    within = torch.arange(total) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)  # [total]
    src = torch.tensor([base[e[0]] + e[1] for e in entries], dtype=torch.long)[entry] + within
    dst = torch.tensor([e[3] * width + e[4] for e in entries], dtype=torch.long)[entry] + within
    plan[dst] = flat[src].long()
    return plan


def routing_problem(group: TrainGroup, layers: int, k: int, experts: int) -> str | None:
    """Why a group cannot be trained under `r3` (a sample without routing, or routing of another model), or None."""
    for i, s in enumerate(group.scored.rollout.samples):
        r = s.routed_experts
        if r is None:
            return f"sample {i} carries no routed experts (trainer.moe.routing_replay r3 needs the rollout's routing)"
        if tuple(r.shape[1:]) != (layers, k):
            return f"sample {i}: routing for {r.shape[1]} layers x top-{r.shape[2]}, the model has {layers} x top-{k}"
        ids = routed_experts(r)
        if ids is not None and ids.numel() and int(ids.max()) >= experts:
            return f"sample {i}: an expert id outside the model's {experts} experts"
    return None


class TrainerRouting:
    """The trainer's routing replay: plans per forward, R2's recorded routing, and the step's metrics."""

    def __init__(self, model: nn.Module, mode: str, fraction: float) -> None:
        self.mode = mode
        self.layers, self.k, self.experts = routing_shape(model)
        self.fraction = fraction
        self._saved: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self._measuring = False
        self._sums: dict[str, float] = {}

    def problem(self, group: TrainGroup) -> str | None:
        """Why `group` cannot be trained under this mode, or None."""
        return routing_problem(group, self.layers, self.k, self.experts) if self.mode == "r3" else None

    def begin_step(self) -> None:
        """A new step: forget R2's routing, measure during the first update."""
        self._saved.clear()
        self._measuring = self.mode == "r3"
        self._sums = {"agree": 0.0, "forced": 0.0, "replay": 0.0, "replay_max": 0.0, "free": 0.0, "free_max": 0.0}
        self._sums.update(tokens=0.0, free_tokens=0.0)

    def measured(self) -> None:
        """The step's metrics are taken (after the old-policy pass, or else the first update)."""
        self._measuring = False

    @contextmanager
    def forward(
        self, model: nn.Module, batch: Batch, rows: Sequence[int], shared: bool, old_pass: bool
    ) -> Iterator[RoutingReplayer | None]:
        """Around the forward of `rows` (`batch` holds all of the step's rows): replay, or (R2's old pass) record."""
        key = tuple(rows)
        if self.mode == "r2" and old_pass:
            with recording(model) as recorder:
                yield None
            self._saved[key] = [c.to(torch.int16) for c in recorder.calls]
            return
        plans = self._plans(batch, rows, shared) if self.mode == "r3" else self._saved.get(key)
        if plans is None:  # r2 with one update per step: nothing recorded, nothing to force
            yield None
            return
        with replaying(model, plans, count_agreement=self._measuring) as replayer:
            yield replayer

    def _plans(self, batch: Batch, rows: Sequence[int], shared: bool) -> list[torch.Tensor]:
        routes = [batch.routing[r] for r in rows]
        if not shared:
            return [plain_plan(routes, max(batch.lengths[r] for r in rows), self.layers, self.k)]
        first: dict[int, int] = {}
        for i, r in enumerate(rows):
            first.setdefault(batch.group_of[r], i)
        prompts = [batch.prompt_lengths[r] for r in rows]
        responses = [batch.lengths[r] - batch.prompt_lengths[r] for r in rows]
        return grouped_plan(routes, prompts, responses, list(first.values()))

    def measure(
        self, model: nn.Module, mb: Batch, logp: torch.Tensor, replayer: RoutingReplayer | None, temperature: float
    ) -> None:
        """In the step's first update: agreement and mismatch with replay from this forward, and the mismatch
        without replay from one more no-grad forward of a sample of its rows."""
        if not self._measuring or replayer is None:
            return
        s = self._sums
        s["agree"] += replayer.agree
        s["forced"] += replayer.forced
        gap = (logp.detach().float() - mb.rollout_logp).abs() * mb.mask  # [R, T-1]
        s["replay"] += float(gap.sum())
        s["replay_max"] = max(s["replay_max"], float(gap.max()))
        s["tokens"] += float(mb.mask.sum())
        if self.fraction == 0:
            return
        count = max(1, math.ceil(len(mb.lengths) * self.fraction))
        pick = torch.linspace(0, len(mb.lengths) - 1, count).round().long().unique()
        with torch.no_grad():
            free = token_logprobs(model, mb.ids[pick], mb.attention[pick], temperature)  # [r, T-1]
        gap = (free.float() - mb.rollout_logp[pick]).abs() * mb.mask[pick]
        s["free"] += float(gap.sum())
        s["free_max"] = max(s["free_max"], float(gap.max()))
        s["free_tokens"] += float(mb.mask[pick].sum())

    def metrics(self) -> dict[str, float]:
        """The step's routing metrics (none unless `r3`)."""
        s = self._sums
        if self.mode != "r3" or not s:
            return {}
        out = {
            "routing_agreement": s["agree"] / max(s["forced"], 1.0),
            "routing_mismatch_replay": s["replay"] / max(s["tokens"], 1.0),
            "routing_mismatch_replay_max": s["replay_max"],
        }
        if self.fraction > 0:
            out.update(
                routing_mismatch_free=s["free"] / max(s["free_tokens"], 1.0), routing_mismatch_free_max=s["free_max"]
            )
        return out

"""`relax replay RUN --step N`: recompute one optimizer step of a finished or running run exactly.

The actor records, per step, the train-stream sequences of the groups it trained (`step_trained`
events) and the step's metrics (`Metric` events); after a restart the last record of a step number is
the one whose update survived. Replay loads the newest kept checkpoint taken before step N, re-applies
the recorded steps between it and N, then runs step N on its recorded groups and compares the
recomputed metrics (the loss first) with the logged ones. A single-process trainer is reproduced to
float rounding; a multi-rank (FSDP2) trainer reduces across ranks in an order one process does not
reproduce, so replay refuses it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.js.errors
import torch

from relax_bus.bus import Bus
from relax_bus.envelope import open_message
from schemas import Metric, RunEvent, TrainGroup
from workers.data.models import materialize
from workers.errors import ReplayFailed
from workers.roles.actor_checkpoint import kept_checkpoints
from workers.training.trainer import PolicyTrainer

COMPARED = ("loss", "kl", "grad_norm", "reward_mean", "response_tokens")


@dataclass
class StepRecord:
    """What the actor logged about one step (its surviving record)."""

    groups: list[str]
    seqs: list[int]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Replay:
    """The outcome of a replay: the logged and the recomputed metrics of one step."""

    run: str
    step: int
    checkpoint_step: int
    replayed_steps: list[int]
    groups: list[str]
    logged: dict[str, float]
    recomputed: dict[str, float]

    @property
    def loss_error(self) -> float:
        return abs(self.recomputed["loss"] - self.logged["loss"])

    def matches(self, tolerance: float = 1e-5) -> bool:
        """True when the recomputed loss equals the logged one within `tolerance` (absolute + relative)."""
        return self.loss_error <= tolerance * (1.0 + abs(self.logged["loss"]))

    def as_dict(self) -> dict[str, Any]:
        return {**vars(self), "loss_error": self.loss_error, "matches": self.matches()}


async def history(bus: Bus) -> dict[int, StepRecord]:
    """Step -> its surviving record, read from the run's events stream."""
    stream = bus.topology.stream("events").name
    state = (await bus.js.stream_info(stream)).state
    records: dict[int, StepRecord] = {}
    metrics: dict[int, dict[str, float]] = {}
    for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
        try:
            raw = await bus.js.get_msg(stream, seq)
        except nats.js.errors.NotFoundError:
            continue  # tolerated: a gap left by the stream's limits
        event = await open_message(raw.data or b"", raw.headers, bus.media)
        if isinstance(event, RunEvent) and event.event == "step_trained":
            step = int(event.fields["step"])  # type: ignore[arg-type]
            groups = str(event.fields["groups"]).split(",")
            seqs = [int(s) for s in str(event.fields["seqs"]).split(",")]
            records[step] = StepRecord(groups, seqs)
        elif isinstance(event, Metric):
            metrics[event.step] = dict(event.values)
    for step, record in records.items():
        record.metrics = metrics.get(step, {})
    return records


async def train_groups(bus: Bus, record: StepRecord, step: int) -> list[TrainGroup]:
    """The exact train messages of a step, by stream sequence, checked against the recorded group ids."""
    stream = bus.topology.stream("train").name
    out = []
    for seq, group_id in zip(record.seqs, record.groups, strict=True):
        try:
            raw = await bus.js.get_msg(stream, seq)
        except nats.js.errors.NotFoundError:
            raise ReplayFailed(
                f"train message {seq} of step {step} is gone from {stream} (bus.train_max_age_s / train_max_bytes)"
            ) from None
        group = await open_message(raw.data or b"", raw.headers, bus.media, TrainGroup)
        assert isinstance(group, TrainGroup)
        if group.group_id != group_id:
            raise ReplayFailed(f"train message {seq} holds group {group.group_id}, step {step} recorded {group_id}")
        out.append(group)
    return out


async def replay(bus: Bus, step: int, work_dir: Path) -> Replay:
    """Recompute step `step` of the run on `bus` from the newest kept checkpoint before it."""
    cfg = bus.config
    if cfg.trainer.distributed.nproc > 1:
        raise ReplayFailed(
            f"run {bus.run} trained on {cfg.trainer.distributed.nproc} ranks; replay reproduces 1-rank trainers"
        )
    records = await history(bus)
    if step not in records or not records[step].metrics:
        known = f"1..{max(records)}" if records else "none"
        raise ReplayFailed(f"run {bus.run} has no complete record of step {step} (recorded steps: {known})")
    where = await kept_checkpoints(bus)
    kept = [s for s in where if s < step]
    if not kept:
        raise ReplayFailed(f"run {bus.run} keeps no checkpoint before step {step} (raise trainer.checkpoint.keep)")
    base = kept[-1]
    between = list(range(base + 1, step))
    missing = [s for s in between if s not in records]
    if missing:
        raise ReplayFailed(f"steps {missing} between checkpoint {base} and step {step} have no record")
    batches = [await train_groups(bus, records[s], s) for s in [*between, step]]
    found = where[base]
    data = b"" if "dir" in found else await bus.checkpoints.get(found["object"])
    model_dir = await asyncio.to_thread(materialize, cfg.model.source, work_dir / bus.run / "base", cfg.model.seed)

    def compute() -> dict[str, float]:
        torch.set_num_threads(1)  # as the actor ran (`relax worker --threads 1`): same reduction order
        trainer = PolicyTrainer(model_dir, cfg)
        trainer.checkpoints.restore_recorded(found, data)
        for groups in batches[:-1]:
            trainer.step(groups)
        return trainer.step(batches[-1])

    recomputed = await asyncio.to_thread(compute)
    logged = records[step].metrics
    return Replay(
        run=bus.run,
        step=step,
        checkpoint_step=base,
        replayed_steps=between,
        groups=records[step].groups,
        logged={k: logged[k] for k in COMPARED if k in logged},
        recomputed={k: recomputed[k] for k in COMPARED if k in recomputed},
    )


def render(r: Replay) -> str:
    """A small table of logged vs recomputed metrics."""
    lines = [
        f"run {r.run}, step {r.step}: from checkpoint of step {r.checkpoint_step}"
        + (f", re-applied steps {r.replayed_steps[0]}..{r.replayed_steps[-1]}" if r.replayed_steps else ""),
        f"groups: {', '.join(r.groups)}",
        f"{'metric':<16}{'logged':>16}{'recomputed':>16}{'difference':>14}",
    ]
    for key, value in r.logged.items():
        again = r.recomputed.get(key, float("nan"))
        lines.append(f"{key:<16}{value:>16.8g}{again:>16.8g}{abs(again - value):>14.3g}")
    lines.append("loss reproduced" if r.matches() else f"loss NOT reproduced (error {r.loss_error:.3g})")
    return "\n".join(lines)

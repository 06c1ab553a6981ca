"""Staleness, as small pure functions. See docs/architecture.md, "Staleness: one number".

    v       trainer policy version (optimizer updates published so far)
    v_s     version of the weights that generated a sample group (the oldest, if it spanned an update)
    S       max_staleness; None means unbounded
    B       groups per optimizer step

    lag(v, v_s)     = v - v_s
    stale           <=> S is not None and lag > S
    release budget  = (v + S + 1) * B + dropped      (None when S is None: unbounded)
    sync floor      = v - S   a rollout worker holding older weights must sync before generating

The trainer's filter (`decide`) is the guarantee; the feeder's credit rule only avoids wasted work.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

POLICY_VERSION = "policy.version"
"""The key of the run's state bucket that holds `v` (written by the trainer: `relax_bus.policy_version`)."""


class Verdict(StrEnum):
    """What happens to a group at the trainer."""

    TRAIN = "train"
    DROP = "drop"
    REQUEUE = "requeue"


@dataclass(frozen=True)
class Decision:
    """A verdict with the lag behind it and, for anything but TRAIN, a readable reason."""

    verdict: Verdict
    lag: int
    reason: str = ""


def lag(trainer_version: int, sample_version: int) -> int:
    """Policy versions between the trainer now and the weights that generated the sample."""
    if trainer_version < 0 or sample_version < 0:
        raise ValueError(f"versions are non-negative (trainer {trainer_version}, sample {sample_version})")
    if sample_version > trainer_version:
        raise ValueError(f"sample version {sample_version} is ahead of trainer version {trainer_version}")
    return trainer_version - sample_version


def is_stale(lag_: int, max_staleness: int | None) -> bool:
    """True when a lag exceeds the bound (never, when the bound is None)."""
    return max_staleness is not None and lag_ > max_staleness


def decide(
    trainer_version: int,
    sample_version: int,
    max_staleness: int | None,
    action: Literal["drop", "requeue"],
    attempt: int,
    max_requeues: int,
) -> Decision:
    """Train a fresh-enough group; otherwise drop it, or requeue its prompt while attempts remain."""
    lag_ = lag(trainer_version, sample_version)
    if not is_stale(lag_, max_staleness):
        return Decision(Verdict.TRAIN, lag_)
    why = f"stale: lag {lag_} > max_staleness {max_staleness} (trainer v{trainer_version}, sample v{sample_version})"
    if action == "requeue" and attempt < max_requeues:
        return Decision(Verdict.REQUEUE, lag_, f"{why}; requeued as attempt {attempt + 1}")
    if action == "requeue":
        return Decision(Verdict.DROP, lag_, f"{why}; requeue limit {max_requeues} reached")
    return Decision(Verdict.DROP, lag_, why)


def release_budget(trainer_version: int, max_staleness: int | None, groups_per_step: int, dropped: int) -> int | None:
    """Total groups the feeder may have released so far; None when unbounded.

    (v + S + 1) * B + dropped: with S = 0 the feeder releases exactly one step's groups ahead of
    the trainer, and every dropped group frees one slot.
    """
    if max_staleness is None:
        return None
    if min(trainer_version, max_staleness, dropped) < 0 or groups_per_step < 1:
        raise ValueError("versions, staleness and drop counts are non-negative; groups_per_step >= 1")
    return (trainer_version + max_staleness + 1) * groups_per_step + dropped


def releasable(
    released: int, trainer_version: int, max_staleness: int | None, groups_per_step: int, dropped: int
) -> int | None:
    """How many more groups the feeder may release now (0 or more); None when unbounded."""
    budget = release_budget(trainer_version, max_staleness, groups_per_step, dropped)
    return None if budget is None else max(0, budget - released)


def sync_floor(trainer_version: int, max_staleness: int | None) -> int:
    """Oldest weights version a rollout worker may still generate with."""
    if max_staleness is None:
        return 0
    return max(0, trainer_version - max_staleness)


def must_sync(held_version: int, trainer_version: int, max_staleness: int | None) -> bool:
    """True when a rollout worker's weights are too old to generate with."""
    return held_version < sync_floor(trainer_version, max_staleness)

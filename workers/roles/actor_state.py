"""What the actor keeps across a restart (inside each checkpoint), and how checkpoints are named and pruned."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.roles.ledger import RangeSet

CHECKPOINT_PREFIX = "ckpt-"
"""Checkpoint objects in the weights store are `ckpt-<step>`."""


@dataclass
class ActorState:
    """What survives a restart (inside each checkpoint)."""

    step: int = 0
    version: int = 0
    floor: int = 0
    """Train-stream sequence at or below which every message is settled (where a restart rewinds to)."""
    trained: RangeSet = field(default_factory=RangeSet)
    """Release indices of every group trained (see `workers.roles.ledger`: copies can arrive at any sequence)."""
    settled: set[str] = field(default_factory=set)
    """`group_id/attempt` of every group dropped or requeued."""
    dropped: int = 0
    """Groups dropped as stale in this history; written whole to `groups.dropped` (the feeder's credit)."""

    def to_extra(self) -> dict[str, Any]:
        """Plain values for the checkpoint."""
        return {**vars(self), "trained": self.trained.ranges(), "settled": sorted(self.settled)}

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ActorState:
        return cls(
            step=int(extra["step"]),
            version=int(extra["version"]),
            floor=int(extra["floor"]),
            trained=RangeSet.from_ranges(extra.get("trained", [])),
            settled=set(extra.get("settled", [])),
            dropped=int(extra.get("dropped", 0)),
        )


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint object's name (`ckpt-<step>`); None for any other object."""
    tail = name.removeprefix(CHECKPOINT_PREFIX)
    return int(tail) if tail != name and tail.isdigit() else None


def retain_checkpoints(names: list[Any], trainer: Any) -> tuple[list[str], list[str]]:
    """Split checkpoint names into (kept, pruned): step 0's and the newest `trainer.checkpoint.keep` stay."""
    by_step = {checkpoint_step(n): n for n in names if isinstance(n, str) and checkpoint_step(n) is not None}
    steps = sorted(s for s in by_step if s)
    kept = [by_step[s] for s in ([0] if 0 in by_step else []) + steps[-trainer.checkpoint.keep :]]
    return kept, [by_step[s] for s in steps[: -trainer.checkpoint.keep]]

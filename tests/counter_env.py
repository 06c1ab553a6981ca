"""Tiny environments for the environment service's tests, served as `tests.counter_env:Counter` and the like.

`Counter` is deterministic: each observation is `<turn>:<action>:<total>`, where the total adds up the lengths of
every action so far (plus the `start` option), so a replay that lost or repeated an action shows in the text.
The action `boom` raises, `stop` ends the episode, `slow` blocks until `Counter.release` is set.
"""

from __future__ import annotations

import threading
from typing import ClassVar

from workers.envs.base import EnvItem, StepResult


class Counter:
    """Counts the turns and the characters of the actions."""

    name: ClassVar[str] = "counter"
    deterministic: ClassVar[bool] = True
    release: ClassVar[threading.Event] = threading.Event()
    """Set to let every `slow` action return."""

    def __init__(self, start: int = 0) -> None:
        self.start = start
        self.turn = 0
        self.total = start

    def reset(self, item: EnvItem) -> str:
        self.turn, self.total = 0, self.start + item.seed
        return f"start {item.prompt} at {self.total}"

    def step(self, action: str) -> StepResult:
        if action == "boom":
            raise RuntimeError("boom: the counter refuses this action\nsecond line never sent")
        if action == "slow":
            self.release.wait(30)
        self.turn += 1
        self.total += len(action)
        return StepResult(f"{self.turn}:{action}:{self.total}", reward=float(self.turn), done=action == "stop")


class ClosingCounter(Counter):
    """A counter that records its `close()` (an environment holding something, e.g. a sandbox)."""

    name: ClassVar[str] = "closing_counter"
    closed: ClassVar[list[int]] = []
    """The `start` of every instance closed, in order."""

    def close(self) -> None:
        self.closed.append(self.start)


class NoisyCounter(Counter):
    """A counter that says it cannot be replayed."""

    name: ClassVar[str] = "noisy_counter"
    deterministic: ClassVar[bool] = False


def expected(actions: list[str], start: int = 0, seed: int = 0) -> list[str]:
    """The observations `Counter` gives for `actions`, computed here independently of the class."""
    total, out = start + seed, []
    for turn, action in enumerate(actions, 1):
        total += len(action)
        out.append(f"{turn}:{action}:{total}")
    return out

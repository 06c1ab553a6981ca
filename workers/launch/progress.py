"""Live progress of a run on the launcher's terminal: a bar with reward, lag, throughput, queue depths and, once
steps come, their rate and the time left (`eta_s`).

The values come from the run's events, which any role may publish: a value a step's metric lacks shows as `-`.
Before the first step, the roles' start-up stages (`workers.roles.stages`: loading a model, warming up, the first
engine call) are printed as they come, each with the seconds since the launch, so a slow start is never silent."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import IO


def eta_s(step: int, total: int, first_step: int, first_at: float, now: float) -> float | None:
    """Seconds left at `step` of `total`, at the rate since the first step seen (`first_step` at `first_at`):

        rate = (step - first_step) / (now - first_at)        steps per second
        eta  = (total - step) / rate

    None before a second step (no rate yet) or when no time has passed; 0 once `step >= total`."""
    if step >= total:
        return 0.0
    done, elapsed = step - first_step, now - first_at
    if done <= 0 or elapsed <= 0:
        return None
    return (total - step) * elapsed / done


def clock(seconds: float) -> str:
    """`seconds` as a short duration: `42s`, `4m05s`, `1h02m`."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Redraws one status line on a terminal; prints a line every few steps otherwise."""

    def __init__(self, total: int, out: IO[str], every: int = 10) -> None:
        self.total = total
        self.out = out
        self.tty = out.isatty()
        self.every = every
        self.started = time.time()
        self.line = ""
        self.first: tuple[int, float] | None = None
        """The first step seen and when: the origin of the rate and the ETA."""

    def update(self, step: int, values: Mapping[str, float], depths: dict[str, int]) -> None:
        """Show `step` with what its values hold (a value the step's metric lacks shows as `-`)."""
        now = time.time()
        if self.first is None:
            self.first = (step, now)
        done = min(1.0, step / self.total) if self.total else 1.0
        bar = "#" * int(done * 24)
        queues = " ".join(f"{k}:{v}" for k, v in depths.items())

        def shown(key: str, spec: str) -> str:
            return format(values[key], spec) if key in values else "-"

        left = eta_s(step, self.total, *self.first, now)
        rate = "" if left is None else f"  {(step - self.first[0]) * 60 / (now - self.first[1]):.1f} steps/min"
        self.line = (
            f"[{bar:<24}] step {step}/{self.total}  reward {shown('reward_mean', '.3f')}  "
            f"lag {shown('lag_mean', '.2f')} (max {shown('lag_max', '.0f')})  "
            f"tok/s {shown('rollout_tokens_per_s', '.0f')}  train {shown('train_s', '.2f')}s  "
            f"dropped {shown('dropped', '.0f')}  queues {queues}  {now - self.started:.0f}s"
            f"{rate}  ETA {'-' if left is None else clock(left)}"
        )
        if self.tty:
            self.out.write("\r\x1b[2K" + self.line)
        elif step % self.every == 0 or step == self.total or step == 1:
            self.out.write(self.line + "\n")
        self.out.flush()

    def stage(self, source: str, stage: str) -> None:
        """A role's start-up stage, on its own line: `[  12s] rollout: loading model`."""
        self.note(f"[{time.time() - self.started:5.0f}s] {source}: {stage}")

    def note(self, text: str) -> None:
        """A message on its own line (the bar is redrawn after it)."""
        if self.tty:
            self.out.write("\r\x1b[2K" + text + "\n" + self.line)
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.tty and self.line:
            self.out.write("\n")
            self.out.flush()

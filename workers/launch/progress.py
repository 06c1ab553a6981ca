"""Live progress of a run on the launcher's terminal: a bar with reward, lag, throughput, queue depths.

The values come from the run's events, which any role may publish: a value a step's metric lacks shows as `-`."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import IO


class Progress:
    """Redraws one status line on a terminal; prints a line every few steps otherwise."""

    def __init__(self, total: int, out: IO[str], every: int = 10) -> None:
        self.total = total
        self.out = out
        self.tty = out.isatty()
        self.every = every
        self.started = time.time()
        self.line = ""

    def update(self, step: int, values: Mapping[str, float], depths: dict[str, int]) -> None:
        """Show `step` with what its values hold (a value the step's metric lacks shows as `-`)."""
        done = min(1.0, step / self.total) if self.total else 1.0
        bar = "#" * int(done * 24)
        queues = " ".join(f"{k}:{v}" for k, v in depths.items())

        def shown(key: str, spec: str) -> str:
            return format(values[key], spec) if key in values else "-"

        self.line = (
            f"[{bar:<24}] step {step}/{self.total}  reward {shown('reward_mean', '.3f')}  "
            f"lag {shown('lag_mean', '.2f')} (max {shown('lag_max', '.0f')})  "
            f"tok/s {shown('rollout_tokens_per_s', '.0f')}  train {shown('train_s', '.2f')}s  "
            f"dropped {shown('dropped', '.0f')}  queues {queues}  {time.time() - self.started:.0f}s"
        )
        if self.tty:
            self.out.write("\r\x1b[2K" + self.line)
        elif step % self.every == 0 or step == self.total or step == 1:
            self.out.write(self.line + "\n")
        self.out.flush()

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

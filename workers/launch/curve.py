"""The reward curve of a run, drawn from its metrics.jsonl: reward against step and against wall time."""

from __future__ import annotations

import json
from pathlib import Path


def draw_curve(metrics: Path, target: Path, title: str = "") -> Path | None:
    """Write a PNG with two panels (reward vs step, vs wall seconds); None when there are no metrics."""
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    wall = [r["wall_s"] for r in rows]
    reward = [r["reward_mean"] for r in rows]
    smooth = _moving_average(reward, 5)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, x, label in ((a, steps, "optimizer step"), (b, wall, "seconds since the actor started")):
        ax.plot(x, reward, color="#9ecae1", linewidth=1, label="reward (step mean)")
        ax.plot(x, smooth, color="#08519c", linewidth=2, label="moving average (5)")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    a.set_ylabel("mean reward")
    a.set_ylim(-0.02, 1.02)
    a.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


def _moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out

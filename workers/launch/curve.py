"""The reward curve of a run, drawn from its metrics.jsonl: reward against step and against wall time.

A run with media prompts also logs `reward/<modality>` (image, audio, video, text, omni); each gets a curve of
its own (a moving average over 20 steps: a step holds only a few groups of each modality)."""

from __future__ import annotations

import json
from pathlib import Path


def draw_curve(metrics: Path, target: Path, title: str = "") -> Path | None:
    """Write a PNG with two panels (reward vs step, vs wall seconds); None when there are no metrics."""
    rows = metric_rows(metrics)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    wall = [r["wall_s"] for r in rows]
    reward = [r["reward_mean"] for r in rows]
    smooth = moving_average(reward, 5)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, x, label in ((a, steps, "optimizer step"), (b, wall, "seconds since the actor started")):
        ax.plot(x, reward, color="#9ecae1", linewidth=1, label="reward (step mean)")
        ax.plot(x, smooth, color="#08519c", linewidth=2, label="moving average (5)")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    palette = {"image": "#e6550d", "audio": "#31a354", "video": "#756bb1", "text": "#636363", "omni": "#d6616b"}
    for name in sorted({k for r in rows for k in r if k.startswith("reward/")}):
        kept = [
            (s, w, r[name]) for s, w, r in zip(steps, wall, rows, strict=True) if isinstance(r.get(name), int | float)
        ]
        values = moving_average([v for _, _, v in kept], 20)
        colour = palette.get(name.removeprefix("reward/"))
        a.plot([s for s, _, _ in kept], values, color=colour, linewidth=1.5, label=f"{name} (moving average 20)")
        b.plot([w for _, w, _ in kept], values, color=colour, linewidth=1.5)
    a.set_ylabel("mean reward")
    a.set_ylim(-0.02, 1.02)
    a.legend(loc="best", fontsize=8, framealpha=0.8)
    fig.suptitle(title)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


def metric_rows(metrics: Path) -> list[dict[str, float]]:
    """The steps of a metrics.jsonl that carry step, wall_s and reward_mean, in order; empty when there is none."""
    if not metrics.exists():
        return []
    return [r for r in map(_row, metrics.read_text().splitlines()) if r is not None]


def _row(line: str) -> dict[str, float] | None:
    """A line of metrics.jsonl with the numbers a curve needs (step, wall_s, reward_mean), else None: a torn line
    or a step whose metric lacks them draws nothing."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    numbers = isinstance(row, dict) and all(
        isinstance(row.get(k), int | float) and not isinstance(row.get(k), bool)
        for k in ("step", "wall_s", "reward_mean")
    )
    return row if numbers else None


def moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out

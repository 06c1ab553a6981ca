"""The reward curve of a run, drawn from its metrics.jsonl: reward against step and against wall time.

A run with media prompts also logs `reward/<modality>` (image, audio, video, text, omni); each gets a curve of
its own (a moving average over 20 steps: a step holds only a few groups of each modality). A reward of several
terms (`reward/<term>/mean`, two or more of them) gets a dashed line per term (moving average 5). The y-axis
follows what is drawn (`y_limits`): [0, 1] widened to every value, so a reward of 1.5 or a negative penalty shows.
A run with a held-out evaluation (`eval.jsonl` beside metrics.jsonl) gets its greedy accuracy and pass@k as markers
on the step panel, at the policy version evaluated (version v: the weights after v optimizer steps)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

MODALITY_COLOURS = {"image": "#e6550d", "audio": "#31a354", "video": "#756bb1", "text": "#636363", "omni": "#d6616b"}
"""The modalities of `reward/<modality>` (`workers.omni.media_refs.modality`) and their colours."""
MARGIN = 0.02
"""Room above and below the drawn values, as a fraction of the y-axis range."""


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
    drawn = [*reward, *smooth]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, x, label in ((a, steps, "optimizer step"), (b, wall, "seconds since the actor started")):
        ax.plot(x, reward, color="#9ecae1", linewidth=1, label="reward (step mean)")
        ax.plot(x, smooth, color="#08519c", linewidth=2, label="moving average (5)")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    for line in extra_lines(rows):
        kept = [(s, w, r[line.name]) for s, w, r in zip(steps, wall, rows, strict=True) if _number(r.get(line.name))]
        values = moving_average([v for _, _, v in kept], line.window)
        drawn += values
        style = {"color": line.colour, "linestyle": line.style, "linewidth": 1.5}
        a.plot([s for s, _, _ in kept], values, **style, label=f"{line.name} (moving average {line.window})")
        b.plot([w for _, w, _ in kept], values, **style)
    for name, colour, marker in eval_series(evals := eval_rows(metrics.with_name("eval.jsonl"))):
        kept = [(r["eval/version"], r[name]) for r in evals if _number(r.get(name))]
        drawn += [v for _, v in kept]
        label = "held-out greedy accuracy" if name == "eval/greedy_accuracy" else "held-out pass@k"
        a.plot([x for x, _ in kept], [v for _, v in kept], color=colour, marker=marker, linewidth=1, label=label)
    a.set_ylabel("mean reward")
    a.set_ylim(*y_limits(drawn))
    a.legend(loc="best", fontsize=8, framealpha=0.8)
    fig.suptitle(title)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


class Line(NamedTuple):
    """A curve drawn besides the reward's: the metric, its moving average's window, colour and line style."""

    name: str
    window: int
    colour: str
    style: str


def extra_lines(rows: list[dict[str, float]]) -> list[Line]:
    """The curves besides the reward's: one per modality (`reward/<modality>`), and one per reward term
    (`reward/<term>/mean`) when there are two or more terms."""
    lines = [Line(f"reward/{m}", 20, MODALITY_COLOURS[m], "-") for m in modality_names(rows)]
    terms = term_names(rows)
    if len(terms) > 1:
        lines += [Line(f"reward/{t}/mean", 5, f"C{i % 10}", "--") for i, t in enumerate(terms)]
    return lines


def eval_series(rows: list[dict[str, float]]) -> list[tuple[str, str, str]]:
    """The held-out values drawn (name, colour, marker): greedy accuracy and pass@k, those the evaluations hold."""
    names = {k for r in rows for k in r}
    drawn = (("eval/greedy_accuracy", "#d62728", "o"), ("eval/pass_at_k", "#ff7f0e", "s"))
    return [line for line in drawn if line[0] in names]


def eval_rows(path: Path) -> list[dict[str, float]]:
    """The evaluations of an eval.jsonl that carry a numeric `eval/version`, in version order (empty: none)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn line draws nothing
        if isinstance(row, dict) and _number(row.get("eval/version")):
            rows.append(row)
    return sorted(rows, key=lambda r: r["eval/version"])


def y_limits(values: Iterable[float], margin: float = MARGIN) -> tuple[float, float]:
    """The y-axis of a reward curve: [low, high] = [min(0, values), max(1, values)] over the finite values, widened
    by `margin` x (high - low) on each side: (-0.02, 1.02) for rewards within [0, 1]."""
    finite = [v for v in values if math.isfinite(v)]
    low, high = min([0.0, *finite]), max([1.0, *finite])
    pad = margin * (high - low)
    return low - pad, high + pad


def term_names(rows: Iterable[dict[str, float]]) -> list[str]:
    """The reward terms the steps report (`reward/<term>/mean`), in name order."""
    names = {
        k.split("/")[1]
        for r in rows
        for k in r
        if k.count("/") == 2 and k.startswith("reward/") and k.endswith("/mean")
    }
    return sorted(n for n in names if n)


def modality_names(rows: Iterable[dict[str, float]]) -> list[str]:
    """The modalities the steps report a reward of (`reward/<modality>`), in name order."""
    return sorted({k.removeprefix("reward/") for r in rows for k in r} & set(MODALITY_COLOURS))


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
    """The mean of each value and the `window - 1` before it, over the finite ones (NaN where none is)."""
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)

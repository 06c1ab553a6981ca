"""`relax compare RUN_DIR...`: runs side by side, from their metrics.jsonl: how far each one's reward rose (the mean
of its first tenth of steps against its last tenth), with the agentic figures when the run had episodes, and
their reward curves on one PNG."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from workers.launch.curve import metric_rows, moving_average, y_limits

TENTH_METRICS = ("reward_mean", "episode_tool_calls_mean", "tool_call_valid_fraction")


@dataclass(frozen=True)
class RunFigures:
    """One run's figures: its name, steps, wall seconds, and (first tenth, last tenth) means of `TENTH_METRICS`."""

    name: str
    steps: int
    wall_s: float
    tenths: dict[str, tuple[float, float]]

    @property
    def rise(self) -> float:
        first, last = self.tenths["reward_mean"]
        return last - first


def figures(run_dir: Path) -> RunFigures:
    """A run's figures from `<run_dir>/metrics.jsonl`; ValueError when it holds no step."""
    rows = metric_rows(run_dir / "metrics.jsonl")
    if not rows:
        raise ValueError(f"{run_dir}: no metrics.jsonl with steps (is it a run directory of `relax run`?)")
    tenth = max(1, len(rows) // 10)
    tenths = {}
    for name in TENTH_METRICS:
        values = [r.get(name) for r in rows]
        first = _mean(values[:tenth])
        last = _mean(values[-tenth:])
        if not (math.isnan(first) and math.isnan(last)):
            tenths[name] = (first, last)
    return RunFigures(run_dir.name, len(rows), float(rows[-1]["wall_s"]), tenths)


def table(runs: list[RunFigures]) -> str:
    """The figures as a plain-text table."""
    head = f"{'run':<20} {'steps':>5} {'wall s':>7} {'reward first->last tenth':>26} {'rise':>6} {'tool calls':>14}"
    lines = [head, "-" * len(head)]
    for r in runs:
        first, last = r.tenths["reward_mean"]
        calls = r.tenths.get("episode_tool_calls_mean")
        calls_text = f"{calls[0]:.2f} -> {calls[1]:.2f}" if calls else "-"
        lines.append(
            f"{r.name:<20} {r.steps:>5} {r.wall_s:>7.0f} {f'{first:.3f} -> {last:.3f}':>26} {r.rise:>+6.3f} "
            f"{calls_text:>14}"
        )
    return "\n".join(lines)


def draw(run_dirs: list[Path], target: Path) -> Path:
    """Every run's reward (moving average of 5 steps) against its step, on one PNG; the y-axis follows the lines
    (`curve.y_limits`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    drawn: list[float] = []
    for run_dir in run_dirs:
        rows = metric_rows(run_dir / "metrics.jsonl")
        smooth = moving_average([r["reward_mean"] for r in rows], 5)
        drawn += smooth
        ax.plot([r["step"] for r in rows], smooth, linewidth=2, label=run_dir.name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward (moving average 5)")
    ax.set_ylim(*y_limits(drawn))
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


def compare(run_dirs: list[Path], out: Path | None) -> tuple[str, dict[str, object]]:
    """The table as text (and the PNG written to `out`, the figures beside it as JSON); the figures as data."""
    runs = [figures(d) for d in run_dirs]
    text = table(runs)
    result: dict[str, object] = {"runs": [r.__dict__ | {"rise": r.rise} for r in runs]}
    if out is not None:
        result["curve"] = str(draw(run_dirs, out))
        text += f"\ncurves: {out}"
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    return text, result


def _mean(values: list[object]) -> float:
    numbers = [float(v) for v in values if isinstance(v, int | float) and not math.isnan(float(v))]
    return sum(numbers) / len(numbers) if numbers else float("nan")

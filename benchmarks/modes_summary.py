"""The modes benchmark's summaries: per-run rates, rewards, lags and idle times, the spread of final rewards
across staleness modes, the figures a new results file replaces, and the reward plot (`benchmarks/modes.py`)."""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path
from typing import Any

from colocated import moving_average


def label(mode: str) -> str:
    return "unbounded" if mode == "unbounded" else f"staleness {mode}"


def summarise(name: str, rows: list[dict[str, float]], args: argparse.Namespace) -> dict[str, Any]:
    """Rates and rewards shared by every run (rows: one per step with at, reward_mean)."""
    first, last = rows[0], rows[-1]
    wall = last["at"] - first["at"]
    smooth = moving_average([r["reward_mean"] for r in rows])
    reached = next((r["at"] - first["at"] for r, s in zip(rows, smooth, strict=True) if s >= args.threshold), None)
    return {
        "mode": name,
        "steps": len(rows),
        "wall_s": wall,
        "steps_per_hour": (len(rows) - 1) / wall * 3600,
        "time_to_threshold_s": reached,
        "reward_final": statistics.fmean(r["reward_mean"] for r in rows[-args.last :]),
        "reward_first": statistics.fmean(r["reward_mean"] for r in rows[: args.last]),
    }


def summarise_bus(name: str, run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rows = run["metrics"]
    out = summarise(name, rows, args)
    later = rows[1:]
    step_s = sum(m["step_s"] for m in later)
    lags: collections.Counter[int] = collections.Counter()
    for m in rows:
        for key, value in m.items():
            if key.startswith("lag_") and key[4:].isdigit():
                lags[int(key[4:])] += int(value)
    by_id = {g.group_id: g for g in run["groups"]}
    trained_later = [gid for step, ids in run["steps"].items() if step >= 2 for gid in ids]
    calls = {(by_id[g].scored.rollout.worker_id, by_id[g].scored.rollout.timings.generate_s) for g in trained_later}
    generate_s = sum(seconds for _, seconds in calls)
    workers = max(1, len({worker for worker, _ in calls}))
    last = rows[-1]
    out.update(
        startup_s=rows[0]["at"] - run["started"],
        lag_histogram={str(k): v for k, v in sorted(lags.items())},
        dropped=int(last["dropped"]),
        requeued=int(last["requeued"]),
        trainer_idle=sum(m["data_wait_s"] for m in later) / step_s,
        data_wait_s=statistics.fmean(m["data_wait_s"] for m in later),
        rollout_idle=1 - generate_s / (out["wall_s"] * workers),
        train_s=statistics.fmean(m["train_s"] for m in later),
        generate_per_step_s=generate_s / max(1, len(later)),
        trainer_bus_frac=sum(m["admit_s"] + m["ack_s"] + m["weight_sync_s"] for m in later) / step_s,
    )
    return out


def draw(runs: dict[str, list[dict[str, float]]], target: Path, threshold: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, rows in runs.items():
        t0 = rows[0]["at"]
        ax.plot([r["at"] - t0 for r in rows], moving_average([r["reward_mean"] for r in rows]), label=name)
    ax.axhline(threshold, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("seconds since the first optimizer step")
    ax.set_ylabel("reward (moving average of 5 steps)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("demo task: reward against wall time per staleness mode")
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    plt.close(fig)


def spreads(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per correction: each mode's final reward averaged over the repeats, and the largest distance of a mode's
    average from max_staleness 0's, for the trained groups' reward (`reward_final`) and for the final weights'
    measured reward (`reward_eval`)."""
    out: dict[str, dict[str, Any]] = {}
    piped = [r for r in rows if r["mode"] != "colocated"]
    keys = ("reward_final", "reward_eval")
    for correction in dict.fromkeys(r["correction"] for r in piped):
        same = [r for r in piped if r["correction"] == correction]
        means = {
            mode: {k: statistics.fmean(r[k] for r in same if r["mode"] == mode) for k in keys}
            for mode in dict.fromkeys(r["mode"] for r in same)
        }
        base = means.get(label("0"))
        if base is not None:
            out[correction] = {"means": means, **{k: max(abs(m[k] - base[k]) for m in means.values()) for k in keys}}
    return out


def previous_figures(out: Path) -> dict[str, Any] | None:
    """The final rewards of the results file this invocation replaces, kept next to the new ones."""
    if not out.exists():
        return None
    old = json.loads(out.read_text())
    keys = ("mode", "correction", "repeat", "default", "reward_final", "reward_eval", "lag_histogram")
    return {
        "when": old.get("when"),
        "command": old.get("command"),
        "rows": [{k: r[k] for k in keys if k in r} for r in old.get("rows", [])],
    }


def lag_text(histogram: dict[str, int]) -> str:
    """`lag:groups` pairs, or mean and max when there are many lags (the whole histogram is in the JSON)."""
    if len(histogram) <= 4:
        return " ".join(f"{k}:{v}" for k, v in histogram.items()) or "-"
    total = sum(histogram.values())
    mean = sum(int(k) * v for k, v in histogram.items()) / total
    return f"{len(histogram)} lags, mean {mean:.1f}, max {max(int(k) for k in histogram)}"

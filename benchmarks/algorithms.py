"""The demo task under each advantage estimator, policy loss and off-policy correction: same seed, same steps.

    python benchmarks/algorithms.py [--steps 120] [--rows all|NAME,NAME] [--last 10] [--work-dir runs/bench-algorithms]
                                    [--out benchmarks/results/algorithms.json]

examples/demo.yaml's task, model and warm-up (run once, in this process; every row starts from the weights it
leaves), then `--steps` colocated GRPO steps per row (generate, score, train; `benchmarks/colocated.py`'s `Colocated`,
no bus, one torch thread). The engine runs ONE VERSION BEHIND the trainer, as a `max_staleness: 1` run does in
steady state (SIMULATED here: after each step the engine loads the previous step's weights), so the off-policy
corrections have a gap to correct. Each row changes only what its name says from the demo's settings. Reported:
reward of the first and last `--last` steps (means), the step of the first 5-step moving average above 0.6, and
seconds per step (medians; the machine's load moves them). One seed: differences under ~0.1 are noise.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from colocated import DEMO, Colocated, moving_average, warm_start
from pipeline import write_results

from workers.config import PipelineConfig, load_config

ROWS: dict[str, dict[str, Any]] = {
    "grpo + ppo + icepop (default)": {},
    "drgrpo": {"advantage": "drgrpo"},
    "rloo": {"advantage": "rloo"},
    "reinforce_pp": {"advantage": "reinforce_pp"},
    "reinforce_pp_baseline": {"advantage": "reinforce_pp_baseline"},
    "grpo whitened": {"advantage": {"type": "grpo", "whiten": True}},
    "ppo 4 updates": {"mini_batches": 4},
    "dual_clip 4 updates": {"mini_batches": 4, "loss": "dual_clip"},
    "gspo 4 updates": {
        "mini_batches": 4,
        "loss": {"type": "gspo", "clip_low": 3e-4, "clip_high": 4e-4},
        "aggregation": "sequence",
    },
    "cispo 4 updates": {"mini_batches": 4, "loss": "cispo"},
    "tis": {"correction": "tis"},
    "seq_is": {"correction": "seq_is"},
    "no correction": {"correction": "none"},
}


def row_config(base: PipelineConfig, trainer: dict[str, Any], warm: Path, steps: int) -> PipelineConfig:
    data = base.model_dump()
    data["run"] = "bench-algorithms"
    data["model"]["source"] = str(warm)
    data["trainer"].update(steps=steps, **trainer)
    data["trainer"]["checkpoint"]["every"] = steps
    data["trainer"]["warmup"]["max_steps"] = 0
    return PipelineConfig.model_validate(data)


def one_behind(colocated: Colocated) -> None:
    """Make the engine load, after each step, the weights of the step before (one version of lag)."""
    load = colocated.engine.load_state_dict
    previous: list[dict[str, torch.Tensor]] = [{k: v.clone() for k, v in colocated.trainer.full_state().items()}]

    def lagging(state: dict[str, torch.Tensor], version: int) -> None:
        load(previous.pop(), max(version - 1, 0))
        previous.append({k: v.detach().clone() for k, v in state.items()})

    colocated.engine.load_state_dict = lagging  # type: ignore[method-assign]


def run_row(config: PipelineConfig, warm: Path, steps: int) -> list[dict[str, float]]:
    torch.manual_seed(0)
    colocated = Colocated(config, warm)
    one_behind(colocated)
    rows = []
    try:
        for step in range(steps):
            rows.append(colocated.step(step))
    finally:
        colocated.close()
    return rows


def summarise(name: str, rows: list[dict[str, float]], last: int, threshold: float) -> dict[str, Any]:
    rewards = [r["reward_mean"] for r in rows]
    smooth = moving_average(rewards)
    reached = next((i + 1 for i, v in enumerate(smooth) if v >= threshold), None)
    return {
        "row": name,
        "reward_first": statistics.fmean(rewards[:last]),
        "reward_final": statistics.fmean(rewards[-last:]),
        "step_to_threshold": reached,
        "step_s": statistics.median(r["step_s"] for r in rows),
        "rewards": rewards,
    }


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rows", default="all", help=f"comma-separated names, or all: {', '.join(ROWS)}")
    parser.add_argument("--last", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=0.6)
    parser.add_argument("--work-dir", type=Path, default=Path("runs/bench-algorithms"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "algorithms.json")
    args = parser.parse_args()
    names = list(ROWS) if args.rows == "all" else args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    torch.set_num_threads(1)
    base = load_config(DEMO)
    started = time.perf_counter()
    warm, info = warm_start(base, args.work_dir)
    results = []
    for name in names:
        rows = run_row(row_config(base, ROWS[name], warm, args.steps), warm, args.steps)
        results.append(summarise(name, rows, args.last, args.threshold))
        r = results[-1]
        print(f"{name}: {r['reward_first']:.3f} -> {r['reward_final']:.3f}", flush=True)
    print(f"\nThe demo task, {args.steps} steps per row, engine one version behind (simulated), one seed")
    print(f"| row | first {args.last} | last {args.last} | step to 5-step mean >= {args.threshold} | s per step |")
    print("|---|---|---|---|---|")
    for r in results:
        reached = "never" if r["step_to_threshold"] is None else str(r["step_to_threshold"])
        print(f"| {r['row']} | {r['reward_first']:.3f} | {r['reward_final']:.3f} | {reached} | {r['step_s']:.3f} |")
    payload = {"warmup": info, "rows": results, "seconds": time.perf_counter() - started, "settings": vars(args)}
    write_results("algorithms", args.out, {**payload, "settings": {k: str(v) for k, v in vars(args).items()}})


if __name__ == "__main__":
    main()

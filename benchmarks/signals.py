"""Learning signals on the demo task: GRPO's sequence reward beside on-policy distillation (OPD) from a teacher.

    python benchmarks/signals.py [--steps 200] [--random-steps 100] [--seeds 1] [--only a,b,c,d,e]
                                 [--threshold 0.8] [--teacher-lr 1.5e-3] [--quick]
                                 [--work-dir runs/bench-signals] [--out benchmarks/results/signals.json]

examples/demo.yaml's task and model (tiny:128x2, single-digit addition, 32 prompts x 8 samples, max_staleness 1),
every run a whole pipeline (`pipeline.run_pipeline`: an embedded nats-server, every role a `relax worker` process
with one torch thread), one after the other. Two model directories are built first, once, and kept in --work-dir,
both by `workers.launch.warmup_model.warmed_model` (what `relax model warmup` runs):
- the teacher: the demo's warm-up without label noise (`trainer.warmup.label_noise=0`, `noise_steps=0`) at
  `--teacher-lr` (the demo's 3e-3 reached 0.80 and then collapsed here; the warm-up restores its best check);
- the noisy start: the demo's own warm-up (clean, then 150 steps with 70 % wrong answers).
Their sampled accuracy is measured over every task item x `--eval-samples` samples (`colocated.evaluate`).
Then, from the noisy start, `--steps` steps each: (a) GRPO (the demo as is), (b) OPD (`teacher: {coef: 1,
reward_coef: 0}`: the teacher's per-token signal alone; the rewards are computed and logged only), (c) OPD + reward
(`reward_coef: 1`); from a random-init student (`trainer.warmup.max_steps=0`), `--random-steps` steps each: (d) GRPO,
(e) OPD. `--seeds N` repeats every run with rollout seeds 0..N-1.

Per run: reward (the student's sampled accuracy: the demo's exact-match reward) of the first and last tenth of the
steps, the first step whose 5-step moving average reaches --threshold, mean step seconds (`step_s`, steps 2..N),
wall seconds (the actor's `wall_s` at its last step), and the reward at equal wall time: each run's 5-step average
at the last step it finished within the wall time the fastest run of the same start and seed took. OPD runs add the
mean `distill_reverse_kl` of the first and last tenth and the teacher role's cost, read two ways: the teacher
process's CPU seconds per step during the run (/proc, steps 2..N; it includes the worker's idle polling), and
`workers.roles.reference.replayed_logprobs` on the teacher timed after the run over its own train groups (this
process, one torch thread, no other run going). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from colocated import DEMO, evaluate, moving_average
from pipeline import PipelineResult, run_pipeline, write_results

from relax_bus import log
from schemas import TrainGroup
from workers.config import PipelineConfig, load_config
from workers.data.model_build import SOURCE_FILE
from workers.data.models import load_model
from workers.launch.warmup_model import warmed_model
from workers.roles.reference import replayed_logprobs


@dataclass(frozen=True)
class Spec:
    """One run of the comparison."""

    signal: str
    start: str
    """`noisy` (the demo's warm-up) or `random` (no warm-up)."""
    reward_coef: float | None
    """The teacher section's reward_coef; None: no teacher (GRPO)."""


RUNS: dict[str, Spec] = {
    "a": Spec("GRPO", "noisy", None),
    "b": Spec("OPD", "noisy", 0.0),
    "c": Spec("OPD + reward", "noisy", 1.0),
    "d": Spec("GRPO", "random", None),
    "e": Spec("OPD", "random", 0.0),
}


def built(config: PipelineConfig, out: Path) -> dict[str, Any]:
    """`config`'s policy after its warm-up as a model directory at `out`, written once: the record beside the weights
    (read back when a previous invocation wrote it)."""
    record = out / SOURCE_FILE
    if record.is_file():
        return dict(json.loads(record.read_text()))
    shutil.rmtree(out, ignore_errors=True)  # a directory left half-written
    return warmed_model(config, out)


def teacher_config(lr: float) -> PipelineConfig:
    """The demo's warm-up with clean labels only, at `lr`."""
    return load_config(
        DEMO, {"trainer.warmup.label_noise": 0, "trainer.warmup.noise_steps": 0, "trainer.warmup.lr": lr}
    )


def accuracy(config: PipelineConfig, model_dir: Path, n: int) -> float:
    """Sampled accuracy of the model in `model_dir`: every task item x n samples at the run's temperature."""
    return evaluate(config, model_dir, load_model(model_dir).state_dict(), n)


def run_config(base: PipelineConfig, key: str, seed: int, steps: int, noisy: Path, teacher: Path) -> PipelineConfig:
    """The demo as run `key` sets it: its start, its teacher section (none for GRPO), `steps` steps."""
    spec = RUNS[key]
    data = base.model_dump()
    data.pop("chain", None)  # derived from the rest
    data["run"] = f"signals-{key}-s{seed}"
    data["rollout"]["seed"] = seed
    data["trainer"]["steps"] = steps
    data["trainer"]["checkpoint"]["every"] = steps
    data["trainer"]["warmup"]["max_steps"] = 0
    if spec.start == "noisy":
        data["model"]["source"] = str(noisy)
    if spec.reward_coef is not None:
        data["teacher"] = {"source": str(teacher), "coef": 1.0, "reward_coef": spec.reward_coef}
    return PipelineConfig.model_validate(data)


def teacher_timing(teacher: Path, groups: list[TrainGroup], temperature: float, limit: int) -> dict[str, float]:
    """The teacher role's forward (`replayed_logprobs`) over up to `limit` of the run's groups, spread over the run:
    median seconds per group, and samples and tokens per second."""
    model = load_model(teacher)
    model.eval()
    picked = groups[:: max(1, len(groups) // limit)][:limit]
    seconds = []
    with torch.no_grad():
        replayed_logprobs(model, picked[0].scored.rollout, temperature, replay=False)  # one-off set-up costs
        for group in picked:
            started = time.perf_counter()
            replayed_logprobs(model, group.scored.rollout, temperature, replay=False)
            seconds.append(time.perf_counter() - started)
    per_group = statistics.median(seconds)
    samples = statistics.fmean(len(g.scored.rollout.samples) for g in picked)
    tokens = statistics.fmean(sum(s.token_ids.numel for s in g.scored.rollout.samples) for g in picked)
    return {
        "groups_timed": float(len(picked)),
        "group_ms": per_group * 1e3,
        "samples_per_s": samples / per_group,
        "tokens_per_s": tokens / per_group,
    }


def summarise(key: str, seed: int, result: PipelineResult, threshold: float) -> dict[str, Any]:
    """One run's figures (see the module docstring), with its reward and wall-time curves."""
    spec = RUNS[key]
    rows = sorted(result.metrics, key=lambda m: m["step"])
    rewards = [m["reward_mean"] for m in rows]
    tenth = max(1, len(rows) // 10)
    smooth = moving_average(rewards)
    steady = rows[1:] or rows  # step 1 waits for every process to start
    first, last = result.cpu[0], result.cpu[-1]
    counted = max(1.0, rows[-1]["step"] - rows[0]["step"])
    out: dict[str, Any] = {
        "run": key,
        "signal": spec.signal,
        "start": spec.start,
        "seed": seed,
        "steps": len(rows),
        "reward_first": statistics.fmean(rewards[:tenth]),
        "reward_last": statistics.fmean(rewards[-tenth:]),
        "step_to_threshold": next((int(rows[i]["step"]) for i, v in enumerate(smooth) if v >= threshold), None),
        "step_s": statistics.fmean(m["step_s"] for m in steady),
        "train_s": statistics.fmean(m["train_s"] for m in steady),
        "wall_s": rows[-1]["wall_s"],
        "cpu_s_per_step": {name: (last[name] - first[name]) / counted for name in last},
        "cpu_s_per_step_total": sum(last[name] - first[name] for name in last) / counted,
        "rewards": rewards,
        "wall": [m["wall_s"] for m in rows],
        "grad_norm": [m["grad_norm"] for m in rows],
    }
    if spec.reward_coef is not None:
        kls = [m["distill_reverse_kl"] for m in rows]
        out.update(reverse_kl_first=statistics.fmean(kls[:tenth]), reverse_kl_last=statistics.fmean(kls[-tenth:]))
        out["reverse_kl"] = kls
    return out


def compare(rows: list[dict[str, Any]], groups_per_step: int) -> dict[str, dict[str, float]]:
    """Fill in each run's reward at equal wall time and the teacher's share of a step; return the step-cost ratios
    OPD / GRPO of the runs with the same start and seed: of the mean step_s, and of the CPU seconds per step of
    every process together (which the machine's other load moves less)."""
    ratios: dict[str, dict[str, float]] = {}
    for start in ("noisy", "random"):
        for seed in {r["seed"] for r in rows}:
            same = [r for r in rows if r["start"] == start and r["seed"] == seed]
            if not same:
                continue
            budget = min(r["wall_s"] for r in same)
            for r in same:
                done = [j for j, w in enumerate(r["wall"]) if w <= budget + 1e-6]  # steps finished within the budget
                step, reward = (done[-1] + 1, moving_average(r["rewards"])[done[-1]]) if done else (None, None)
                r["equal_wall"] = {"wall_s": budget, "step": step, "reward": reward}
            grpo = next((r for r in same if r["signal"] == "GRPO"), None)
            for r in same:
                if grpo is not None and r is not grpo:
                    ratios[f"{r['run']}/{grpo['run']} seed {seed}"] = {
                        "step_s": r["step_s"] / grpo["step_s"],
                        "cpu_s": r["cpu_s_per_step_total"] / grpo["cpu_s_per_step_total"],
                    }
    for r in rows:
        if "teacher_timing" in r:
            per_step = groups_per_step * r["teacher_timing"]["group_ms"] / 1e3
            r["teacher_share_of_step"] = per_step / r["step_s"]
            r["teacher_cpu_share_of_step"] = r["cpu_s_per_step"].get("teacher-0", 0.0) / r["step_s"]
    return ratios


def over_seeds(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per run, its figures over the seeds: means (and the range of the last tenth's reward), every seed's step to
    the threshold, and the step-cost ratios against the GRPO run of the same start."""
    out: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys(r["run"] for r in rows):
        mine = [r for r in rows if r["run"] == key]
        last = [r["reward_last"] for r in mine]
        out[key] = {
            "signal": mine[0]["signal"],
            "start": mine[0]["start"],
            "seeds": len(mine),
            "reward_first": statistics.fmean(r["reward_first"] for r in mine),
            "reward_last": statistics.fmean(last),
            "reward_last_range": [min(last), max(last)],
            "step_to_threshold": [r["step_to_threshold"] for r in mine],
            "equal_wall_reward": statistics.fmean(r["equal_wall"]["reward"] or 0.0 for r in mine),
            "step_s": statistics.fmean(r["step_s"] for r in mine),
            "cpu_s_per_step_total": statistics.fmean(r["cpu_s_per_step_total"] for r in mine),
        }
        if "reverse_kl_first" in mine[0]:
            out[key]["reverse_kl_first"] = statistics.fmean(r["reverse_kl_first"] for r in mine)
            out[key]["reverse_kl_last"] = statistics.fmean(r["reverse_kl_last"] for r in mine)
    for summary in out.values():
        grpo = next((o for o in out.values() if o["start"] == summary["start"] and o["signal"] == "GRPO"), None)
        if grpo is not None and summary is not grpo:
            summary["step_s_vs_grpo"] = summary["step_s"] / grpo["step_s"]
            summary["cpu_s_vs_grpo"] = summary["cpu_s_per_step_total"] / grpo["cpu_s_per_step_total"]
    return out


def table(rows: list[dict[str, Any]], threshold: float) -> str:
    head = (
        f"| run | start | signal | seed | steps | reward first 10 % | last 10 % | step to 5-step mean >= {threshold} | "
        "s per step | CPU s per step | load 1m | wall s | reward at equal wall (s) | reverse KL first -> last | "
        "teacher ms/group | teacher samples/s | teacher share of step (timed / CPU) |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        reached = "never" if r["step_to_threshold"] is None else str(r["step_to_threshold"])
        eq = r["equal_wall"]
        at_wall = "-" if eq["step"] is None else f"{eq['reward']:.3f} (step {eq['step']}, {eq['wall_s']:.0f} s)"
        kl = f"{r['reverse_kl_first']:.3f} -> {r['reverse_kl_last']:.3f}" if "reverse_kl_first" in r else "-"
        t = r.get("teacher_timing")
        teacher = (
            f"{t['group_ms']:.1f} | {t['samples_per_s']:.0f} | "
            f"{r['teacher_share_of_step']:.0%} / {r['teacher_cpu_share_of_step']:.0%}"
            if t
            else "- | - | -"
        )
        lines.append(
            f"| {r['run']} | {r['start']} | {r['signal']} | {r['seed']} | {r['steps']} | {r['reward_first']:.3f} | "
            f"{r['reward_last']:.3f} | {reached} | {r['step_s']:.3f} | "
            f"{r['cpu_s_per_step_total']:.3f} | {max(r['load_average_1m_before_after']):.1f} | {r['wall_s']:.0f} | "
            f"{at_wall} | {kl} | {teacher} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="steps of each run from the noisy start (200)")
    p.add_argument("--random-steps", type=int, default=100, help="steps of each run from random init (100)")
    p.add_argument("--seeds", type=int, default=1, help="rollout seeds 0..N-1, every run once per seed (1)")
    p.add_argument("--only", default=",".join(RUNS), help=f"runs to do, comma-separated ({','.join(RUNS)})")
    p.add_argument("--threshold", type=float, default=0.8, help="reward for the step-to-threshold column (0.8)")
    p.add_argument("--teacher-lr", type=float, default=1.5e-3, help="the teacher's warm-up learning rate (1.5e-3)")
    p.add_argument("--eval-samples", type=int, default=16, help="samples per task item for the accuracies (16)")
    p.add_argument("--timed-groups", type=int, default=64, help="groups of each OPD run the teacher is timed on (64)")
    p.add_argument("--quick", action="store_true", help="a smoke test: 4 and 3 steps, 2 samples, 4 timed groups")
    p.add_argument("--work-dir", type=Path, default=Path("runs/bench-signals"), help="models and run directories")
    p.add_argument("--out", type=Path, help="JSON (default benchmarks/results/signals.json; --quick: in --work-dir)")
    args = p.parse_args()
    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    if unknown := [k for k in keys if k not in RUNS]:
        raise SystemExit(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
    if args.quick:
        args.steps, args.random_steps, args.eval_samples, args.timed_groups = 4, 3, 2, 4
    out = args.out or (
        args.work_dir / "signals_quick.json" if args.quick else Path(__file__).parent / "results" / "signals.json"
    )
    log.configure("warning")
    torch.set_num_threads(1)  # as every role process runs
    started, load_before = time.perf_counter(), os.getloadavg()
    base = load_config(DEMO)

    teacher_dir = args.work_dir / f"teacher-lr{args.teacher_lr:g}"
    teacher = {"dir": str(teacher_dir), "lr": args.teacher_lr, **built(teacher_config(args.teacher_lr), teacher_dir)}
    teacher["accuracy"] = accuracy(base, teacher_dir, args.eval_samples)
    noisy_dir = args.work_dir / "noisy-start"
    noisy = {"dir": str(noisy_dir), **built(base, noisy_dir)}
    noisy["accuracy"] = accuracy(base, noisy_dir, args.eval_samples)
    for name, m in (("teacher", teacher), ("noisy start", noisy)):
        print(f"{name}: {m['warmup_steps']:.0f} warm-up steps, sampled accuracy {m['accuracy']:.3f}", flush=True)

    rows = []
    for seed in range(args.seeds):
        for key in keys:
            steps = args.steps if RUNS[key].start == "noisy" else args.random_steps
            config = run_config(base, key, seed, steps, noisy_dir, teacher_dir)
            distills = config.teacher is not None
            run_dir = args.work_dir / config.run
            shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: an old store would resume it
            load = os.getloadavg()[0]
            result = asyncio.run(
                run_pipeline(config, run_dir, rollout_workers=1, read_train=distills, timeout_s=300 + 10 * steps)
            )
            row = summarise(key, seed, result, args.threshold)
            row["load_average_1m_before_after"] = [load, os.getloadavg()[0]]
            if distills:
                temperature = config.rollout.temperature
                row["teacher_timing"] = teacher_timing(teacher_dir, result.train_groups, temperature, args.timed_groups)
            rows.append(row)
            print(
                f"{key} {row['signal']} from {row['start']}, seed {seed}: reward {row['reward_first']:.3f} -> "
                f"{row['reward_last']:.3f} in {steps} steps, {row['step_s']:.3f} s/step, {row['wall_s']:.0f} s",
                flush=True,
            )
    ratios = compare(rows, base.groups_per_step)
    print(f"\nThe demo task, one run per row (seed = rollout seed); OPD / GRPO per step: {json.dumps(ratios)}")
    print(table(rows, args.threshold))
    runs = over_seeds(rows)
    if args.seeds > 1:
        print(f"\nOver {args.seeds} seeds (means; last tenth's range; every seed's step to {args.threshold}):")
        for key, m in runs.items():
            low, high = m["reward_last_range"]
            print(
                f"{key} {m['signal']} from {m['start']}: {m['reward_first']:.3f} -> {m['reward_last']:.3f} "
                f"({low:.3f}-{high:.3f}), steps to {args.threshold}: {m['step_to_threshold']}, "
                f"{m['step_s']:.3f} s/step, {m['cpu_s_per_step_total']:.3f} CPU s/step"
            )
    opd = [r for r in rows if r["run"] == "b"]
    target = {
        "goal": f"OPD reaches {args.threshold} sampled accuracy from the noisy start within {args.steps} steps",
        "met": [r["step_to_threshold"] is not None for r in opd],
    }
    payload = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "teacher": teacher,
        "noisy_start": noisy,
        "teacher_cost_method": (
            "teacher_timing: replayed_logprobs on the teacher (one torch thread, this process, after the run) over "
            "the run's own train groups, median per group; teacher_share_of_step = groups_per_step x that / mean "
            "step_s. teacher_cpu_share_of_step: the teacher process's CPU seconds per step during the run (/proc, "
            "steps 2..N, idle polling included) / mean step_s"
        ),
        "step_cost_ratio": ratios,
        "over_seeds": runs,
        "target": target,
        "rows": rows,
        "load_average_before": load_before,
        "seconds": time.perf_counter() - started,
    }
    write_results("signals", out, payload)


if __name__ == "__main__":
    main()

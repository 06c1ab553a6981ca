"""A judge retrained on what a run logged: is it gamed less in the next run?

    python benchmarks/judge_retrain.py [--judge runs/judge-model] [--config examples/judge.yaml] [--seeds 2]
                                       [--contrasts 30] [--work runs/judge-retrain]
                                       [--out benchmarks/results/judge_retrain.json]

Every run is `relax run CONFIG` as a user starts it (every role a process on a real nats-server), with the judge as
the only reward and the rule (`judge.check`) logged beside it, 32 samples a step in the samples log:

1. "before": the judge `--judge` (built by `relax model judge-train CONFIG --out runs/judge-model`), rollout seeds
   0..N-1;
2. the retrain: `relax model judge-train CONFIG --samples <the seed-0 run's samples.jsonl> --contrasts N` from that
   judge (N: `--contrasts`, 30 as the command's default);
3. "after": the retrained judge, the same seeds (seed 1 and up: runs whose samples it never saw).

Per run: the true accuracy (the rule) and the judge's reward, first and last tenth of the steps; the judge's
false-positive share (`judge_false_positive_rate`: samples it said yes to and the rule calls wrong, over all
samples) mean and highest; and, from the samples log, its yes rate on the wrong samples. Per judge, what
`benchmarks/judge_space.py` measures (every item against every answer of the task). Prints a table, writes JSON.
Nothing is simulated; the runs take ~2.5 min each on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RELAX = str(Path(sys.executable).parent / "relax")


def run(config: Path, work: Path, name: str, judge: Path, seed: int, steps: int | None) -> dict[str, Any]:
    """One `relax run` with `judge` as the judge and rollout seed `seed`; its figures (`figures`)."""
    shutil.rmtree(work / "runs" / name, ignore_errors=True)
    overrides = [f"run={name}", f"judge.source={judge}", f"rollout.seed={seed}", "metrics.samples_per_step=32"]
    overrides += [f"trainer.steps={steps}"] if steps else []
    started = time.perf_counter()
    done = subprocess.run([RELAX, "run", str(config), *overrides], cwd=work, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"relax run {name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {"run": name, "judge": str(judge), "seed": seed, "seconds": time.perf_counter() - started} | figures(
        work / "runs" / name
    )


def figures(run_dir: Path) -> dict[str, Any]:
    """A run's judge figures from its metrics.jsonl and samples.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "judge_check_mean" in r]
    tenth = max(1, len(rows) // 10)

    def mean(part: list[dict[str, Any]], key: str) -> float:
        return sum(r[key] for r in part) / len(part)

    fp = [r["judge_false_positive_rate"] for r in rows]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    wrong = [s for s in samples if s["checks"].get("exact", 1.0) < 0.5 and s.get("verdict") is not None]
    return {
        "steps": len(rows),
        "true_first": mean(rows[:tenth], "judge_check_mean"),
        "true_last": mean(rows[-tenth:], "judge_check_mean"),
        "judge_first": mean(rows[:tenth], "judge_score_mean"),
        "judge_last": mean(rows[-tenth:], "judge_score_mean"),
        "fp_share_mean": sum(fp) / len(fp),
        "fp_share_max": max(fp),
        "logged_wrong": len(wrong),
        "yes_on_logged_wrong": sum(s["verdict"] >= 0.5 for s in wrong) / max(1, len(wrong)),
        "samples_log": str(run_dir / "samples.jsonl"),
    }


def retrain(config: Path, work: Path, judge: Path, samples: Path, contrasts: int) -> tuple[Path, dict[str, Any], float]:
    """`relax model judge-train CONFIG --samples SAMPLES --contrasts N` from `judge`: the new judge, its record and
    seconds."""
    out = work / "judge-retrained"
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    command = [RELAX, "model", "judge-train", str(config), f"judge.source={judge}", "--samples", str(samples)]
    command += ["--contrasts", str(contrasts)]
    done = subprocess.run(
        [*command, "--out", str(out)],
        cwd=work,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"relax model judge-train --samples failed ({done.returncode}):\n{done.stderr[-3000:]}")
    print(done.stdout.strip().splitlines()[-1], flush=True)
    return out, json.loads((out / "relax_source.json").read_text()), time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--judge", type=Path, default=ROOT / "runs" / "judge-model", help="the judge to start from")
    p.add_argument("--config", type=Path, default=ROOT / "examples" / "judge.yaml", help="the run config")
    p.add_argument("--seeds", type=int, default=2, help="rollout seeds 0..N-1 per judge (default 2)")
    p.add_argument("--steps", type=int, help="RL steps per run (default: CONFIG's)")
    p.add_argument("--contrasts", type=int, default=30, help="the retrain's --contrasts (default 30; 0: none)")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "judge-retrain", help="where the runs go")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "judge_retrain.json")
    args = p.parse_args()
    if not (args.judge / "config.json").is_file():
        raise SystemExit(f"{args.judge} is not a judge: build one with `relax model judge-train {args.config} --out`")
    judge, config = args.judge.resolve(), args.config.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from judge_space import measure

    rows = []
    for seed in range(args.seeds):
        rows.append({"phase": "before"} | run(config, args.work, f"jr-before-s{seed}", judge, seed, args.steps))
        print(f"before, seed {seed}: {rows[-1]}", flush=True)
    retrained, record, retrain_s = retrain(config, args.work, judge, Path(rows[0]["samples_log"]), args.contrasts)
    for seed in range(args.seeds):
        rows.append({"phase": "after"} | run(config, args.work, f"jr-after-s{seed}", retrained, seed, args.steps))
        print(f"after, seed {seed}: {rows[-1]}", flush=True)
    import torch

    torch.set_num_threads(1)
    space = {"before": measure(judge, config), "after": measure(retrained, config)}

    print(
        "| judge | seed | true accuracy, first -> last tenth | judge reward | false-positive share, mean (max) "
        "| yes on logged wrong samples | s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['phase']} | {r['seed']} | {r['true_first']:.3f} -> {r['true_last']:.3f} | "
            f"{r['judge_first']:.3f} -> {r['judge_last']:.3f} | {r['fp_share_mean']:.3f} ({r['fp_share_max']:.3f}) | "
            f"{r['yes_on_logged_wrong']:.3f} of {r['logged_wrong']} | {r['seconds']:.0f} |"
        )
    print("\n| judge | yes on right | yes on wrong | yes on empty | right answer top-scored |")
    print("|---|---|---|---|---|")
    for phase, s in space.items():
        print(
            f"| {phase} | {s['yes_on_right']:.3f} | {s['yes_on_wrong']:.3f} | {s['yes_on_empty']:.2f} | "
            f"{s['right_answer_top_scored']:.2f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                "config": str(args.config),
                "judge": str(args.judge),
                "retrain": {"contrasts": args.contrasts, "seconds": retrain_s, "record": record},
                "runs": rows,
                "judge_space": space,
            },
            indent=1,
        )
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

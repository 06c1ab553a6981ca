"""Cluster simulation: the real workers, bus, actor loop and weight protocol, with simulated compute.

    python benchmarks/cluster_sim.py [--workers 1,4,16] [--modes 0,1,2,unbounded] [--unit 1.0]
                                     [--steps 24] [--skip 4] [--sigma 1.0] [--max-procs 4] [--out FILE]

The rollout engine is `rollout.engine: sim` (workers/engines/sim_engine.py: a call on k groups sleeps
for the longest of k log-normal group times, a weights load sleeps `load_s`) and the optimizer step is
`trainer.simulate` (workers/training/sim_trainer.py: a sleep). Everything else is the production path: feeder
credit rule, rollout micro-batching and version gating, reward scoring, the actor's collect / judge /
ack loop, real safetensors weights published to the object store and fetched by every rollout worker.
So the cores are not the bottleneck and what is measured is scheduling, staleness gating, the bus and
the weight protocol.

Timing, in units U of one synchronous step (--unit seconds), chosen for the paper's Qwen3-4B setting:
    generation of a whole step's batch (its long tail included)   G = 0.38 U
    optimizer step                                               T = 0.57 U
    weight load on each rollout worker                           L = 0.05 U
In the paper's fully asynchronous mode the trainer is the bottleneck (its data wait is 0.11 s per
step), so an async step is one training step; a 1.76x speedup over a synchronous step G + T + L
then puts training at 1/1.76 = 57% of it. Generation gets 38% and weight sync 5% (a broadcast of
8 GB of bf16 weights takes seconds against steps of minutes). Per-group times are log-normal with
sigma 1 (long-tailed, as response lengths of reasoning models are); their median m is set so the
expected longest of the B groups of a step is G.

Analytic bounds, with W workers each making calls of k = B/W groups and P the measured publish time:
    sync  (max_staleness 0):  step = E[max of B groups] + L + T + P = G + L + T + P
    async (1, 2, unbounded):  step = max(E[max of k groups] + L, T + P)
Reported per run: the measured step period (steady state, after --skip steps), its ratio to the
mode's bound (efficiency), the speedup over max_staleness 0 with the same workers (next to the
bound's and the paper's 1.76x), and the trainer's data wait per step. 16 workers run as 4 host
processes of 4 workers each (benchmarks/pipeline.py host), because 16 processes importing torch do
not fit on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import uuid
from pathlib import Path
from typing import Any

from pipeline import run_pipeline, steady, step_period, write_results

from relax_bus import log
from workers.config import parse_config

PAPER_SPEEDUP = 1.76
GEN_SHARE, TRAIN_SHARE, LOAD_SHARE = 0.38, 0.57, 0.05


def expected_max(k: int, sigma: float, samples: int = 20000, seed: int = 0) -> float:
    """E[max of k LogNormal(0, sigma) draws], by Monte Carlo (a fixed seed: the same value every run)."""
    rng = random.Random(seed)
    return statistics.fmean(max(rng.lognormvariate(0.0, sigma) for _ in range(k)) for _ in range(samples))


def make_config(args: argparse.Namespace, workers: int, mode: str, median: float) -> Any:
    unit = args.unit
    return parse_config(
        {
            "run": f"sim{workers}s{mode[:2]}{uuid.uuid4().hex[:4]}",
            "groups_per_step": args.groups,
            "samples_per_group": args.samples,
            "staleness": {"max_staleness": mode},
            "model": {"source": "tiny:64x2"},
            "task": {"type": "addition", "options": {"seed": 0}},
            "rollout": {
                "engine": {
                    "type": "sim",
                    "group_median_s": median,
                    "group_sigma": args.sigma,
                    "load_s": LOAD_SHARE * unit,
                },
                "max_new_tokens": 4,
                "batch_groups": args.groups // workers,
            },
            "trainer": {
                "steps": args.steps,
                "checkpoint": {"every": args.steps},
                "warmup": {"max_steps": 0},
                "simulate": {"step_s": TRAIN_SHARE * unit},
            },
            "roles": {"reward": 1},
        }
    )


def summarise(metrics: list[dict[str, float]], skip: int) -> dict[str, float]:
    rows = steady(metrics, skip)
    step_s = sum(m["step_s"] for m in rows)
    return {
        "period_s": step_period(metrics, skip),
        "publish_s": statistics.fmean(m["weight_sync_s"] for m in rows),
        "train_s": statistics.fmean(m["train_s"] for m in rows),
        "data_wait_s": statistics.fmean(m["data_wait_s"] for m in rows),
        "data_wait_frac": sum(m["data_wait_s"] for m in rows) / step_s,
        "lag_mean": statistics.fmean(m["lag_mean"] for m in rows),
        "lag_max": max(m["lag_max"] for m in rows),
        "dropped": metrics[-1]["dropped"],
    }


async def bench(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    unit, groups = args.unit, args.groups
    median = GEN_SHARE * unit / expected_max(groups, args.sigma)
    rows = []
    for workers in args.workers:
        k = groups // workers
        call_s = median * expected_max(k, args.sigma)
        for mode in args.modes:
            config = make_config(args, workers, mode, median)
            result = await run_pipeline(config, work / config.run, rollout_workers=workers, max_procs=args.max_procs)
            s = summarise(result.metrics, args.skip)
            load, train, publish = LOAD_SHARE * unit, TRAIN_SHARE * unit, s["publish_s"]
            sync_bound = GEN_SHARE * unit + load + train + publish
            async_bound = max(call_s + load, train + publish)
            bound = sync_bound if mode == "0" else async_bound
            row = {
                "workers": workers,
                "mode": mode,
                "groups_per_call": k,
                "call_s": call_s,
                "sync_bound_s": sync_bound,
                "async_bound_s": async_bound,
                "bound_s": bound,
                "efficiency": bound / s["period_s"],
                **s,
            }
            rows.append(row)
            print(
                f"  W={workers:<2} max_staleness={mode:9} step {s['period_s']:.3f}s (bound {bound:.3f}s, "
                f"{row['efficiency']:.2f}x)  data wait {s['data_wait_frac']:.1%}  lag {s['lag_mean']:.2f}",
                flush=True,
            )
    for row in rows:
        sync = next((r for r in rows if r["workers"] == row["workers"] and r["mode"] == "0"), None)
        row["speedup_vs_sync"] = sync["period_s"] / row["period_s"] if sync else None
        row["bound_speedup"] = row["sync_bound_s"] / row["bound_s"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", default="1,4,16", help="simulated rollout workers (default 1,4,16)")
    p.add_argument("--modes", default="0,1,2,unbounded", help="max_staleness values (default 0,1,2,unbounded)")
    p.add_argument("--unit", type=float, default=1.0, help="seconds of one synchronous step (default 1.0)")
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per run (default 24)")
    p.add_argument("--skip", type=int, default=4, help="first steps left out of the rates (default 4)")
    p.add_argument("--groups", type=int, default=32, help="groups per step (default 32)")
    p.add_argument("--samples", type=int, default=8, help="samples per group (default 8)")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal shape of group times (default 1.0)")
    p.add_argument("--max-procs", type=int, default=4, help="rollout processes at most (default 4)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "cluster_sim.json"))
    args = p.parse_args()
    args.workers = [int(w) for w in args.workers.split(",")]
    args.modes = [m.strip() for m in args.modes.split(",")]
    if any(args.groups % w for w in args.workers):
        p.error("--groups must be a multiple of every worker count")
    log.configure("warning")
    with tempfile.TemporaryDirectory(prefix="cluster-sim-") as work:
        rows = asyncio.run(bench(args, Path(work)))

    header = (
        f"{'workers':>7} {'max_staleness':>13} {'step s':>7} {'bound s':>7} {'of bound':>8} "
        f"{'speedup vs 0':>12} {'bound':>6} {'paper':>6} {'data wait s':>11} {'wait %':>7} {'lag':>5}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        speedup = f"{r['speedup_vs_sync']:.2f}x" if r["speedup_vs_sync"] else "-"
        print(
            f"{r['workers']:>7} {r['mode']:>13} {r['period_s']:7.3f} {r['bound_s']:7.3f} {r['efficiency']:7.2f}x "
            f"{speedup:>12} {r['bound_speedup']:5.2f}x {PAPER_SPEEDUP:5.2f}x "
            f"{r['data_wait_s']:11.3f} {r['data_wait_frac']:6.1%} {r['lag_mean']:5.2f}"
        )
    print(
        f"U = {args.unit:g} s; G:T:L = {GEN_SHARE}:{TRAIN_SHARE}:{LOAD_SHARE} of U; {args.groups} groups x "
        f"{args.samples} samples per step; group times log-normal, sigma {args.sigma:g}; steady state after "
        f"{args.skip} of {args.steps} steps; bound = analytic step time of the mode (sync: G+L+T+P, async: "
        "max(call+L, T+P))"
    )
    write_results("cluster_sim", Path(args.out), {"settings": {**vars(args)}, "rows": rows})


if __name__ == "__main__":
    main()

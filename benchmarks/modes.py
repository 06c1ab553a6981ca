"""Staleness modes on the demo task: max_staleness 0, 1, 2 and unbounded next to a colocated baseline.

    python benchmarks/modes.py [--steps 120] [--modes 0,1,2,unbounded] [--corrections icepop,tis]
                               [--repeats 2] [--rollouts N] [--eval-samples 16] [--threshold 0.6]
                               [--last 10] [--long] [--work-dir runs/bench-modes] [--out FILE]

Same task (examples/demo.yaml: single-digit addition, 32 groups x 8 samples per step), same model
and seed, same step budget. The demo's supervised warm-up runs once, in this process, and every run
starts from the weights it leaves (so no run spends time on it). Then, one after another:
- colocated synchronous baseline: generate, score, train and copy the weights into the engine, in one
  process with the machine's 2 threads, no bus (TorchEngine + PolicyTrainer + the reward scorer);
- phase times with 1 thread each, in this process (what a rollout worker and the actor get in a run);
- one run per max_staleness, off-policy correction and rollout seed (`--repeats`) with the real launcher
  (`relax run`'s `launch`: an embedded nats-server,
  every role a `relax worker` process with one thread);
- the colocated baseline once more; the faster of its two runs counts (two threads on two cores
  stall whenever another process takes a core, so it is the run a shared machine disturbs most).
The overlap bound of this machine is T_colocated_step / max(T_generate@1, T_train@1): the colocated
run's mean step over the mean generation (per step) and training time of the rollout worker and the
actor in the runs. Medians of the in-process phase times give a second reading (one that load on a
shared machine disturbs less), and with 2 threads per phase the bound disjoint devices would have.
Per run: wall time of steps 1..N, steps/hour, time from step 1 until the 5-step moving average of the
reward reaches --threshold, the reward of the groups trained in the last --last steps (samples of old
weights when lags are large), the reward of the weights the run ends with (`colocated.evaluate`: every
task item x --eval-samples, the same seeds for every run), lag histogram, dropped and
requeued groups, trainer idle (data wait / step time, from the actor's Metric), rollout idle
(1 - generation seconds of the groups trained in steps 2..N / (wall time of steps 2..N x rollout workers)), and the
trainer's own bus time (decode and judge, acks, weight publish) per step. Rates exclude step 1 (start-up).
Per correction: each mode's final-weights reward averaged over the seeds and its largest distance from
max_staleness 0's (`spread`); rows run with the config's default correction carry `"default": true`, and
the JSON keeps the rewards of the file it replaces (`previous`).
Prints a table, writes JSON and a PNG of reward against wall time for every run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from colocated import DEMO, evaluate, phase_times, run_colocated, warm_start
from modes_summary import draw, label, lag_text, previous_figures, spreads, summarise, summarise_bus
from pipeline import read_train_groups, write_results

from relax_bus import log
from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.ops.server import EmbeddedServer
from relax_bus.settings import ConnectionSettings
from schemas import RunEvent, decode
from workers.config import PipelineConfig, load_config
from workers.launch.launcher import launch
from workers.weights import make_transport


def mode_config(
    base: PipelineConfig,
    mode: str,
    warm: Path,
    steps: int,
    correction: str | None = None,
    seed: int = 0,
    rollouts: int | None = None,
) -> PipelineConfig:
    """The demo at one max_staleness (and off-policy correction: the config's default when None); `seed` is the
    rollout's sampling seed (a repeat of the same run draws other samples)."""
    data = base.model_dump()
    data["run"] = f"modes-s{mode}" + (f"-{correction}" if correction else "") + (f"-r{seed}" if seed else "")
    data["staleness"]["max_staleness"] = mode
    data["rollout"]["seed"] = seed
    if rollouts:
        data["roles"]["rollout"] = rollouts
    if correction:
        data["trainer"]["correction"] = {"type": correction}
    data["model"]["source"] = str(warm)
    data["trainer"]["steps"] = steps
    data["trainer"]["checkpoint"]["every"] = steps
    data["trainer"]["warmup"]["max_steps"] = 0
    return PipelineConfig.model_validate(data)


async def run_mode(config: PipelineConfig, run_dir: Path) -> dict[str, Any]:
    """One run with the real launcher; returns its metrics, its step records and the rollout timings."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: the previous invocation's store would resume it
    run_dir.mkdir(parents=True)  # noqa: ASYNC240 - a benchmark, nothing else runs meanwhile
    with EmbeddedServer(store_dir=run_dir / "nats") as server, open(run_dir / "progress.log", "w") as out:  # noqa: ASYNC230
        started = time.time()
        summary = await launch(config, run_dir, server.url, out)
        nc = await connect(ConnectionSettings(nats_url=[server.url]), name="bench-modes")
        try:
            bus = await Bus.attach(nc, config.run, PipelineConfig)
            groups = await read_train_groups(bus)
            steps = await step_records(bus)
            final = await make_transport(bus).read(config.trainer.steps)  # the weights the run ends with
        finally:
            await nc.close()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "summary": summary,
        "started": started,
        "metrics": metrics,
        "groups": groups,
        "steps": steps,
        "final": final,
    }


async def step_records(bus: Bus) -> dict[int, list[str]]:
    """step -> ids of the groups it trained, from the actor's step_trained events."""
    stream = bus.topology.stream("events").name
    total = int((await bus.js.stream_info(stream)).state.messages or 0)
    sub = await bus.js.subscribe(bus.topology.subject("events"), ordered_consumer=True)
    out: dict[int, list[str]] = {}
    try:
        for _ in range(total):
            event = decode((await sub.next_msg(timeout=10)).data)
            if isinstance(event, RunEvent) and event.event == "step_trained":
                out[int(event.fields["step"])] = str(event.fields["groups"]).split(",")  # type: ignore[arg-type]
    finally:
        await sub.unsubscribe()
    return out


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work_dir)
    base = load_config(DEMO)
    started = time.perf_counter()
    warm, warm_info = await asyncio.to_thread(warm_start, base, work)
    print(f"warm-up: {warm_info['warmup_steps']:.0f} supervised steps, accuracy {warm_info['warmup_accuracy']:.2f}")
    config = mode_config(base, "0", warm, args.steps)
    colocated, coloc_final = await asyncio.to_thread(run_colocated, config, warm, args.steps, 2)
    print(f"colocated: {colocated[-1]['at'] - colocated[0]['at']:.1f}s", flush=True)
    phases = {
        "2 threads": {
            k: statistics.median(r[k] for r in colocated[1:]) for k in ("gen_s", "score_s", "train_s", "sync_s")
        },
        "1 thread": await asyncio.to_thread(phase_times, config, warm, args.phase_steps, 1),
    }
    torch.set_num_threads(1)  # this process now only follows the runs
    default_correction = base.trainer.correction.type
    results: list[dict[str, Any]] = []
    curves: dict[str, list[dict[str, float]]] = {}
    for repeat in range(args.repeats):
        for mode in args.modes:
            for correction in args.corrections:
                run_config = mode_config(base, mode, warm, args.steps, correction, repeat, args.rollouts)
                run = await run_mode(run_config, work / f"s{mode}-{correction}-r{repeat}")
                row = summarise_bus(label(mode), run, args)
                row.update(
                    correction=correction,
                    repeat=repeat,
                    default=correction == default_correction,
                    reward_eval=await asyncio.to_thread(evaluate, run_config, warm, run["final"], args.eval_samples),
                )
                results.append(row)
                curves[f"max_staleness {mode}, {correction}" + (f", seed {repeat}" if repeat else "")] = run["metrics"]
                print(
                    f"{row['mode']} ({correction}, seed {repeat}): {row['wall_s']:.1f}s, trained reward "
                    f"{row['reward_final']:.2f}, final weights {row['reward_eval']:.2f}",
                    flush=True,
                )
    # Two threads on two cores stall whenever another process takes a core: the colocated run is the one
    # most disturbed by load on a shared machine, so it runs again after the others and the faster counts.
    torch.set_num_threads(2)
    again, again_final = await asyncio.to_thread(run_colocated, config, warm, args.steps, 2)
    torch.set_num_threads(1)
    walls = [rows[-1]["at"] - rows[0]["at"] for rows in (colocated, again)]
    print(f"colocated again: {walls[1]:.1f}s", flush=True)
    colocated, coloc_final = (colocated, coloc_final) if walls[0] <= walls[1] else (again, again_final)
    coloc_eval = await asyncio.to_thread(evaluate, config, warm, coloc_final, args.eval_samples)
    results.insert(
        0,
        {
            **summarise("colocated", colocated, args),
            "walls_s": walls,
            "correction": default_correction,
            "repeat": 0,
            "default": False,
            "reward_eval": coloc_eval,
        },
    )
    curves = {"colocated (2 threads, no bus)": colocated, **curves}
    # Throughput is a mean, so the bound is made of means: the colocated run's step, and generation and
    # training as the rollout worker and the actor (one thread each) did them in the runs above.
    coloc_mean = statistics.fmean(r["step_s"] for r in colocated[1:])
    coloc_median = statistics.median(r["step_s"] for r in colocated[1:])
    piped = results[1:]
    gen1 = statistics.fmean(r["generate_per_step_s"] for r in piped) if piped else phases["1 thread"]["gen_s"]
    train1 = statistics.fmean(r["train_s"] for r in piped) if piped else phases["1 thread"]["train_s"]
    one, two = phases["1 thread"], phases["2 threads"]
    bound = {
        "colocated_step_s": coloc_mean,
        "colocated_step_median_s": coloc_median,
        "gen_1thread_s": gen1,
        "train_1thread_s": train1,
        "overlap_bound": coloc_mean / max(gen1, train1),
        "overlap_bound_medians": coloc_median / max(one["gen_s"], one["train_s"]),
        "disjoint_devices_bound": coloc_median / max(two["gen_s"], two["train_s"]),
    }
    on_policy = next((r for r in results if r["mode"] == label("0") and r["default"]), None)
    for r in results:
        r["speedup_vs_colocated"] = r["steps_per_hour"] / results[0]["steps_per_hour"]
        r["speedup_vs_staleness_0"] = r["steps_per_hour"] / on_policy["steps_per_hour"] if on_policy else None
    draw(curves, Path(args.plot), args.threshold)
    return {
        "settings": {k: v for k, v in vars(args).items()},
        "warmup": warm_info,
        "phases": phases,
        "bound": bound,
        "rows": results,
        "spread": spreads(results),
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=120, help="optimizer steps per run (default 120)")
    p.add_argument("--long", action="store_true", help="250 steps per run, as in the demo")
    p.add_argument("--modes", default="0,1,2,unbounded", help="max_staleness values (default 0,1,2,unbounded)")
    p.add_argument("--corrections", default="tis", help="off-policy corrections, each run in every mode (default tis)")
    p.add_argument(
        "--rollouts",
        type=int,
        default=None,
        help="rollout workers per run (default: the demo's, 1); more workers "
        "make generation outrun training further, so unbounded runs reach larger lags",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs of each mode and correction, rollout seeds 0.. (1)")
    p.add_argument("--eval-samples", type=int, default=16, help="samples per task item for the final weights (16)")
    p.add_argument("--threshold", type=float, default=0.6, help="reward for time-to-threshold (default 0.6)")
    p.add_argument("--last", type=int, default=10, help="steps averaged for the final reward (default 10)")
    p.add_argument("--phase-steps", type=int, default=8, help="steps timed for the 1-thread phases (default 8)")
    p.add_argument("--work-dir", default="runs/bench-modes", help="run directories (metrics, logs, stores)")
    p.add_argument("--plot", default=str(Path(__file__).parent / "results" / "modes_reward.png"))
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "modes.json"))
    args = p.parse_args()
    if args.long:
        args.steps = 250
    args.modes = [m.strip() for m in args.modes.split(",")]
    args.corrections = [c.strip() for c in args.corrections.split(",")]
    log.configure("warning")
    previous = previous_figures(Path(args.out))
    result = asyncio.run(bench(args))
    result["previous"] = previous

    rows, b = result["rows"], result["bound"]
    header = (
        f"{'mode':11} {'corr':6} {'seed':>4} {'wall s':>7} {'steps/h':>8} {'vs coloc':>8} {'vs s=0':>7} "
        f"{'t->' + str(args.threshold):>7} {'reward':>6} {'final':>6} {'drop/req':>8} {'trainer idle':>12} "
        f"{'rollout idle':>12} {'bus':>6}  lag histogram"
    )
    print(header)
    print("-" * (len(header) + 10))
    for r in rows:
        reached = f"{r['time_to_threshold_s']:.1f}" if r["time_to_threshold_s"] is not None else "-"
        vs0 = f"{r['speedup_vs_staleness_0']:.2f}x" if r["speedup_vs_staleness_0"] else "-"
        hist = lag_text(r.get("lag_histogram", {}))
        extra = (
            f"{r['dropped']:>3}/{r['requeued']:<4} {r['trainer_idle']:12.1%} {r['rollout_idle']:12.1%} "
            f"{r['trainer_bus_frac']:6.1%}"
            if "trainer_idle" in r
            else f"{'-':>8} {'-':>12} {'-':>12} {'-':>6}"
        )
        print(
            f"{r['mode']:11} {r['correction']:6} {r['repeat']:4} {r['wall_s']:7.1f} {r['steps_per_hour']:8.0f} "
            f"{r['speedup_vs_colocated']:7.2f}x {vs0:>7} {reached:>7} {r['reward_final']:6.2f} "
            f"{r['reward_eval']:6.2f} {extra}  {hist}"
        )
    print(
        f"\noverlap bound of this machine: colocated step {b['colocated_step_s'] * 1e3:.0f} ms (2 threads, mean) / "
        f"max(generate {b['gen_1thread_s'] * 1e3:.0f} ms, train {b['train_1thread_s'] * 1e3:.0f} ms) as the rollout "
        f"worker and the actor did them in the runs (1 thread each) = {b['overlap_bound']:.2f}x; from medians of "
        f"an in-process measurement: {b['overlap_bound_medians']:.2f}x (1 thread each), "
        f"{b['disjoint_devices_bound']:.2f}x (2 threads each, i.e. disjoint devices)"
    )
    print(
        f"{args.steps} steps per run; wall and rates from step 1 to the last; reward = mean reward of the groups "
        f"trained in the last {args.last} steps (samples of the weights of version step - lag); final = mean reward "
        f"of the weights the run ends with, every task item x {args.eval_samples} samples, the same seeds for every "
        f"row; t->{args.threshold} = seconds from step 1 until the 5-step average reaches it; bus = the trainer's "
        f"decode/judge + acks + weight publish per step; plot: {args.plot}"
    )
    for correction, spread in result["spread"].items():
        means = ", ".join(f"{mode} {m['reward_eval']:.3f}" for mode, m in spread["means"].items())
        print(
            f"{correction}, mean over {args.repeats} seed(s): final weights {means}; largest distance from "
            f"max_staleness 0: {spread['reward_eval']:.3f} (trained reward: {spread['reward_final']:.3f})"
        )
    write_results("modes", Path(args.out), result)


if __name__ == "__main__":
    main()

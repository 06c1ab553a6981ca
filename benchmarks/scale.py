"""Pipeline throughput when the bus is the only cost: groups/s through every role, 1, 2 and 4 rollout workers.

    python benchmarks/scale.py [--workers 1x1,2x1,4x1,4x4] [--groups 3200] [--skip 10] [--out FILE]

Every role runs as its own process on an embedded nats-server (file storage), exactly as in a run,
but generation takes no time (`rollout.engine: sim` with zero delay) and the optimizer step takes
none (`trainer.simulate` with step_s 0); rewards are the task's exact-match scorer, staleness is
unbounded. What is left is the bus: the feeder's publishes, three hops per group (prompts, rollouts,
train) each with fetch, decode, handler, publish and ack, the actor's collect / judge / ack loop,
and one weight version per step published by the actor and fetched by every rollout worker (a
tiny:64x2 model, 0.6 MB). `RxW` runs R rollout and W reward worker processes. Groups/s is measured
in steady state (after --skip steps); the CPU each process used in that window shows where it saturates.

Next to it, in the same invocation and on the same kind of server: raw JetStream throughput at the
size of one train message (benchmarks/bus_throughput.py's raw path: publish_async, then fetch(100)
+ ack) and our path (Publisher + Worker), both as messages/s; a group crosses three hops, so each
bounds the pipeline at a third of its rate.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import uuid
from pathlib import Path
from typing import Any

import nats
from bus_throughput import our_messages, raw_messages
from pipeline import run_pipeline, write_results

from relax_bus import log
from relax_bus.ops.server import EmbeddedServer
from schemas import encode
from workers.config import PipelineConfig, parse_config

HOPS = 3


def make_config(args: argparse.Namespace, workers: int, rewards: int) -> PipelineConfig:
    return parse_config(
        {
            "run": f"scale{workers}x{rewards}{uuid.uuid4().hex[:4]}",
            "groups_per_step": args.groups_per_step,
            "samples_per_group": 8,
            "staleness": {"max_staleness": "unbounded"},
            "model": {"source": "tiny:64x2"},
            "task": {"type": "addition", "options": {"seed": 0}},
            "rollout": {"engine": "sim", "max_new_tokens": 4, "batch_groups": args.groups_per_step},
            "trainer": {
                "steps": args.groups // args.groups_per_step,
                "checkpoint": {"every": args.groups // args.groups_per_step},
                "warmup": {"max_steps": 0},
                "simulate": {"step_s": 0.0},
            },
            "bus": {"max_ack_pending": 1024},
            "roles": {"reward": rewards},
        }
    )


async def raw_rates(size: int, n: int, work: Path) -> dict[str, float]:
    """Raw JetStream and our publish/consume path at `size` bytes, messages/s (best of 2)."""
    best = {"raw": 0.0, "ours": 0.0}
    with EmbeddedServer(store_dir=work / "raw-nats") as server:
        nc = await nats.connect(server.url, max_reconnect_attempts=1)
        try:
            for _ in range(2):
                for side, fn in (("raw", raw_messages), ("ours", our_messages)):
                    r = await fn(nc, size, n)
                    best[side] = max(best[side], n / (r["publish_s"] + r["consume_s"]))
        finally:
            await nc.close()
    return best


async def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rows = []
    message_bytes = 0.0
    for workers, rewards in args.workers:
        config = make_config(args, workers, rewards)
        result = await run_pipeline(config, work / config.run, rollout_workers=workers, read_train=True)
        m, cpu = result.metrics, result.cpu
        i = next(k for k, row in enumerate(m) if row["step"] > args.skip)
        seconds = m[-1]["at"] - m[i]["at"]
        groups = (m[-1]["step"] - m[i]["step"]) * config.groups_per_step
        busy = {name: (cpu[-1][name] - cpu[i][name]) / seconds for name in cpu[-1]}
        message_bytes = statistics.fmean(len(encode(g)) for g in result.train_groups[:50])
        row = {
            "workers": workers,
            "rewards": rewards,
            "groups_per_s": groups / seconds,
            "steps_per_s": (m[-1]["step"] - m[i]["step"]) / seconds,
            "cpu_busy": busy,
            "cpu_total": sum(busy.values()),
            "weight_sync_s": statistics.fmean(r["weight_sync_s"] for r in m[i:]),
            "data_wait_s": statistics.fmean(r["data_wait_s"] for r in m[i:]),
            "lag_mean": statistics.fmean(r["lag_mean"] for r in m[i:]),
        }
        rows.append(row)
        top = max(busy, key=busy.__getitem__)
        print(f"  {workers} rollout x {rewards} reward: {row['groups_per_s']:.0f} groups/s ({top} {busy[top]:.0%})")
    size = max(1024, int(message_bytes))
    raw = await raw_rates(size, args.raw_messages, work)
    return {"rows": rows, "raw": raw, "message_bytes": size, "hops": HOPS}


def by_role(busy: dict[str, float]) -> dict[str, float]:
    """CPU shares summed over the processes of each role (`rollout-0`, `rollout-1` -> `rollout`)."""
    out: dict[str, float] = {}
    for name, share in sorted(busy.items()):
        role = name.rsplit("-", 1)[0] if name[-1].isdigit() else name
        out[role] = out.get(role, 0.0) + share
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", default="1x1,2x1,4x1,4x4", help="rollout x reward processes (default 1x1,2x1,4x1,4x4)")
    p.add_argument("--groups", type=int, default=3200, help="groups per run (default 3200)")
    p.add_argument("--groups-per-step", type=int, default=32, help="groups per step (default 32)")
    p.add_argument("--skip", type=int, default=10, help="first steps left out of the rates (default 10)")
    p.add_argument("--raw-messages", type=int, default=10000, help="messages per raw measurement (default 10000)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "scale.json"))
    args = p.parse_args()
    args.workers = [tuple(int(n) for n in w.split("x")) for w in args.workers.split(",")]
    log.configure("warning")
    with tempfile.TemporaryDirectory(prefix="scale-") as work:
        result = asyncio.run(bench(args, Path(work)))

    raw, ours = result["raw"]["raw"], result["raw"]["ours"]
    header = f"{'rollout x reward':>16} {'groups/s':>9} {'steps/s':>8} {'of raw/3':>8} {'of ours/3':>9}   CPU by role"
    print(header)
    print("-" * (len(header) + 40))
    for r in result["rows"]:
        cpu = "  ".join(f"{role} {share:.0%}" for role, share in by_role(r["cpu_busy"]).items())
        print(
            f"{str(r['workers']) + ' x ' + str(r['rewards']):>16} {r['groups_per_s']:9.0f} {r['steps_per_s']:8.1f} "
            f"{r['groups_per_s'] / (raw / HOPS):7.1%} {r['groups_per_s'] / (ours / HOPS):8.1%}   {cpu}"
        )
    print(
        f"\nraw JetStream at {result['message_bytes']} B: {raw:.0f} msg/s (ceiling {raw / HOPS:.0f} groups/s over "
        f"{HOPS} hops); our Publisher + Worker: {ours:.0f} msg/s (ceiling {ours / HOPS:.0f} groups/s)"
    )
    print(
        f"{args.groups_per_step} groups x 8 samples per step, zero-time engine and optimizer step, unbounded "
        f"staleness; steady state after {args.skip} steps; CPU = share of one core each process used"
    )
    write_results("scale", Path(args.out), {"settings": vars(args), **result})


if __name__ == "__main__":
    main()

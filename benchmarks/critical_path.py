"""The trainer's critical path: per step, the time it spends in the bus against the time its weights take to publish.

    python benchmarks/critical_path.py [--configs demo,demo-ahead,demo-sharded,smollm2-shm,smollm2-shm-sharded]
                                       [--steps 40] [--smollm2-steps 12] [--work-dir runs/bench-critical-path]
                                       [--out FILE]

Each config runs once with the real launcher (`relax run`'s `launch`: an embedded nats-server, every role a
process; the supervised warm-up off, since only step timing is read), checkpointing every 10 steps. `smollm2`
needs the model directory of `make smollm2` (models/SmolLM2-135M-Instruct). A name is the example followed by
variants: `-shm` runs `weights: {type: shm}`, `-sharded` writes sharded checkpoints (`trainer.checkpoint.dir`
in the run directory) instead of whole ones into the object store, `-ahead` sets `trainer.compute.read_ahead: on` (a CPU
trainer's `auto` is off). From the actor's Metric of every step after
the first two:

- step_s: time between two step records (the trainer's whole period);
- bus_s: what the step spent in the bus on its critical path: admit_s (dedupe, staleness judging) + ack_s
  (sent, not confirmed) + weight_sync_s (the snapshot of the new weights, plus waiting for the previous
  version's publish if it is still running) + decode_s (fetching and decoding the step's messages) when the
  actor does not read ahead: counted whole, although part of it overlaps the wait for the step's last groups;
- decode_s with read_ahead: the next step's messages decoded while the current one trains, beside the path and
  not in bus_s (it shares the machine's cores with training: compare step_s);
- weight_publish_s: how long the previous version's publish took in the background (transport write,
  policy.version compare-and-set, announcement);
- checkpoint_path_s: a checkpoint's snapshot (object store: gathering and copying model and optimizer;
  sharded: staging each rank's shards), the only part of it on the critical path, and checkpoint_s, its save
  in the background (serialise and upload, or write the shards; then the record); means over the checkpoints
  seen. checkpoint_frac spreads the snapshot over the 10 steps between checkpoints, as a fraction of the step;
  sync_and_checkpoint_frac adds weight_sync_s: what weights and checkpoints cost the step.

Measured: bus_frac = bus_s / step_s, checkpoint_frac, sync_and_checkpoint_frac. Derived, not measured: the step
as it was when the publish ran on the critical path (before it moved to the background) is
step_s - weight_sync_s + weight_publish_s, and its bus fraction (admit_s + ack_s + weight_publish_s) over that;
the checkpoint's share when its save ran on the path too is (checkpoint_path_s + checkpoint_s) / 10 / step_s.
Both assume the same work in every other phase.
Prints a table and writes JSON.
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

from relax_bus.ops.server import EmbeddedServer
from workers.config import PipelineConfig, load_config
from workers.launch.launcher import launch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"demo": ROOT / "examples" / "demo.yaml", "smollm2": ROOT / "examples" / "smollm2.yaml"}
VARIANTS = {"shm", "sharded", "ahead"}
"""Name parts after the example: `-shm` runs the shared-memory weight transport, `-sharded` writes sharded
checkpoints into the run directory (`trainer.checkpoint.dir`) instead of whole ones into the object store,
`-ahead` reads the next step's groups while a step trains (`trainer.compute.read_ahead: on`)."""
SKIP = 2  # the first steps pay start-up costs (engine warm caches, first weight fetches)
CHECKPOINT_EVERY = 10


def configure(name: str, steps: int, run_dir: Path) -> PipelineConfig:
    """The example config `name` (`<example>[-shm][-sharded]`), `steps` GRPO steps, no warm-up, its own run."""
    example, *variants = name.split("-")
    if example not in CONFIGS or not set(variants) <= VARIANTS:
        raise SystemExit(f"unknown config {name!r}: <{'|'.join(CONFIGS)}> followed by any of -shm, -sharded, -ahead")
    overrides: dict[str, Any] = {
        "run": f"bench-cp-{name}",
        "trainer.steps": steps,
        "trainer.warmup.max_steps": 0,
        "trainer.checkpoint.every": CHECKPOINT_EVERY,
    }
    if example == "demo":
        overrides["trainer.warmup.noise_steps"] = 0
    if "shm" in variants:
        overrides["weights"] = {"type": "shm"}
    if "sharded" in variants:
        overrides["trainer.checkpoint.dir"] = str(run_dir.resolve() / "checkpoints")
    if "ahead" in variants:
        overrides["trainer.compute.read_ahead"] = "on"
    return load_config(CONFIGS[example], overrides)


async def run_one(config: PipelineConfig, run_dir: Path) -> list[dict[str, Any]]:
    """One run with the real launcher; the actor's step metrics."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)  # noqa: ASYNC240 - a benchmark, nothing else runs meanwhile
    with EmbeddedServer(store_dir=run_dir / "nats") as server, open(run_dir / "progress.log", "w") as out:  # noqa: ASYNC230
        await launch(config, run_dir, server.url, out)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def summarise(name: str, metrics: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [m for m in metrics if m["step"] > SKIP]
    if not rows:
        raise SystemExit(f"{name}: no steps after the first {SKIP}; raise --steps")
    keys = ("step_s", "admit_s", "ack_s", "weight_sync_s", "decode_s", "read_ahead")
    mean = {k: statistics.fmean(m.get(k, 0.0) for m in rows) for k in keys}
    publish = statistics.fmean(m.get("weight_publish_s", 0.0) for m in rows)
    on_path_decode = 0.0 if mean["read_ahead"] > 0.5 else mean["decode_s"]
    bus = mean["admit_s"] + mean["ack_s"] + mean["weight_sync_s"] + on_path_decode
    before_step = mean["step_s"] - mean["weight_sync_s"] + publish
    before_bus = mean["admit_s"] + mean["ack_s"] + on_path_decode + publish
    return {
        "config": name,
        "steps": len(rows),
        "step_s": mean["step_s"],
        "admit_s": mean["admit_s"],
        "ack_s": mean["ack_s"],
        "weight_sync_s": mean["weight_sync_s"],
        "decode_s": mean["decode_s"],
        "read_ahead": mean["read_ahead"] > 0.5,
        "weight_publish_s": publish,
        "bus_s": bus,
        "bus_frac": bus / mean["step_s"],
        "derived_step_s_publish_on_path": before_step,
        "derived_bus_frac_publish_on_path": before_bus / before_step,
        **checkpoint_costs(metrics, mean["step_s"], mean["weight_sync_s"]),
    }


def checkpoint_costs(metrics: list[dict[str, Any]], step_s: float, sync_s: float) -> dict[str, Any]:
    """Each checkpoint's snapshot on the critical path and its background save (every step's Metric carries the
    last checkpoint's), spread over the steps between checkpoints, as fractions of the step."""
    seen = sorted({(m["checkpoint_path_s"], m["checkpoint_s"]) for m in metrics if "checkpoint_path_s" in m})
    if not seen:
        return {"checkpoints": 0}
    path = statistics.fmean(p for p, _ in seen)
    save = statistics.fmean(s for _, s in seen)
    return {
        "checkpoints": len(seen),
        "checkpoint_path_s": path,
        "checkpoint_s": save,
        "checkpoint_frac": path / CHECKPOINT_EVERY / step_s,
        "sync_and_checkpoint_frac": (sync_s + path / CHECKPOINT_EVERY) / step_s,
        "derived_checkpoint_frac_save_on_path": (path + save) / CHECKPOINT_EVERY / step_s,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'config':<20} {'steps':>5} {'step s':>8} {'admit s':>8} {'ack s':>7} {'wait s':>7} {'decode s':>8} "
        f"{'publish s':>9} "
        f"{'bus %':>6} {'bus % (publish on path)':>23} {'ckpt path s':>11} {'ckpt save s':>11} "
        f"{'sync+ckpt %':>11} {'ckpt % (save on path)':>21}"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        ckpt = (
            f"{r['checkpoint_path_s']:>11.3f} {r['checkpoint_s']:>11.3f} {100 * r['sync_and_checkpoint_frac']:>10.1f}% "
            f"{100 * r['derived_checkpoint_frac_save_on_path']:>20.1f}%"
            if r["checkpoints"]
            else f"{'-':>11} {'-':>11} {'-':>11} {'-':>21}"
        )
        out.append(
            f"{r['config']:<20} {r['steps']:>5} {r['step_s']:>8.3f} {r['admit_s']:>8.4f} {r['ack_s']:>7.4f} "
            f"{r['weight_sync_s']:>7.4f} {r['decode_s']:>8.4f} {r['weight_publish_s']:>9.4f} "
            f"{100 * r['bus_frac']:>5.1f}% "
            f"{100 * r['derived_bus_frac_publish_on_path']:>22.1f}% {ckpt}"
        )
    return "\n".join(out)


async def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="demo,demo-ahead,demo-sharded,smollm2-shm,smollm2-shm-sharded")
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps of the demo run")
    parser.add_argument("--smollm2-steps", type=int, default=12)
    parser.add_argument("--work-dir", default="runs/bench-critical-path")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "critical_path.json"))
    args = parser.parse_args()
    rows = []
    for name in args.configs.split(","):
        steps = args.smollm2_steps if name.startswith("smollm2") else args.steps
        run_dir = Path(args.work_dir) / name
        started = time.perf_counter()
        metrics = await run_one(configure(name, steps, run_dir), run_dir)
        rows.append({**summarise(name, metrics), "wall_s": time.perf_counter() - started})
        print(f"{name}: {len(metrics)} steps in {rows[-1]['wall_s']:.0f}s", flush=True)
    print(table(rows))
    return {"measured": time.strftime("%Y-%m-%d %H:%M"), "command": "python benchmarks/critical_path.py", "rows": rows}


if __name__ == "__main__":
    cli = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    cli.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "critical_path.json"))
    known, _ = cli.parse_known_args()
    result = asyncio.run(main())
    Path(known.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {known.out}")

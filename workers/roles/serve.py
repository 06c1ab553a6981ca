"""`relax worker ROLE`: one role as one process, given only the NATS URL and the run id.

The role is looked up in the registry (`workers.role_registry`) and its module's `serve(ctx)` runs
it; the run config is read from KV, and the parts of it the role uses (its registry entry's `checks`: the
model, the task, the rewards, the engine) are checked before it starts (`workers.preflight`): a config that
cannot work is refused with exit code 2 and one error, and not restarted. A role whose config spans several
nodes (the trainer with `trainer.distributed.nnodes` > 1) re-executes itself as this node's torchrun agent.
Its log events carry `run`, `role` and `worker` (the worker id its heartbeat shows), from its start.
SIGTERM/SIGINT stop the role gracefully: workers finish or hand back their in-flight messages, the actor
hands back a half-collected step, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_bus.bus import Bus
from relax_bus.cancel import cancel_and_wait
from relax_bus.connection import forget_credentials
from relax_bus.delivery import role_worker
from relax_bus.errors import ConfigError
from relax_bus.log import get_logger
from relax_bus.probe import clear as clear_probe_file
from relax_bus.settings import ConnectionSettings
from relax_bus.worker import Worker
from workers.config import PipelineConfig
from workers.errors import RoleNotInRun
from workers.preflight import preflight
from workers.rewards.sandbox.process import hide
from workers.role_registry import role_def

log = get_logger(__name__)

SANDBOX_HIDES = "RELAX_SANDBOX_HIDES"
"""Paths (os.pathsep-separated) the launcher asks every reward sandbox of the role to mask."""


@dataclass
class RoleContext:
    """What a role's `serve` gets: the connection, the run, its cache, and the stop signal."""

    role: str
    settings: ConnectionSettings
    run: str
    cache: Path
    """This run's local cache (model files)."""
    stop: asyncio.Event
    """Set by SIGTERM/SIGINT: finish or hand back what is in flight, then return."""
    bus: Bus[PipelineConfig] | None = None
    """Connected before `serve` is called."""

    @property
    def connected(self) -> Bus[PipelineConfig]:
        assert self.bus is not None, "serve() runs after the bus is connected"
        return self.bus


async def run_role(
    role: str,
    settings: ConnectionSettings,
    run: str,
    work_dir: Path,
    threads: int = 1,
    heartbeat_file: Path | None = None,
) -> int:
    """Connect (retrying for `settings.connect_retry_s`), run the role until done or stopped; return an exit code.
    With `heartbeat_file`, its heartbeat is mirrored there for the container's probes (`relax probe`).

    The process is one worker of the role (`relax_bus.delivery.role_worker`): its loop's worker id is chosen here,
    and every log event from here on carries `run`, `role` and that `worker`."""
    with role_worker(run, role):
        return await _run_role(role, settings, run, work_dir, threads, heartbeat_file)


async def _run_role(
    role: str, settings: ConnectionSettings, run: str, work_dir: Path, threads: int, heartbeat_file: Path | None
) -> int:
    make_undumpable()
    if heartbeat_file is not None:
        # A container restarted in its pod keeps /tmp: its predecessor's beats must not judge it. (Under torchrun
        # every rank clears it at start; only rank 0 beats, after connecting, so the file is back within a beat.)
        clear_probe_file(heartbeat_file)
    hide(work_dir, *(path.parent for path in _login_files(settings)), *hidden_by_launcher())
    entry = role_def(role)
    if entry.torch_threads:
        import torch

        torch.set_num_threads(threads)
    ctx = RoleContext(role, settings, run, work_dir / run, asyncio.Event())
    module = importlib.import_module(entry.module)
    before_bus: Callable[[RoleContext], Awaitable[bool]] | None = getattr(module, "before_bus", None)
    if before_bus is not None and await before_bus(ctx):
        return 0
    # Stoppable while it waits for its server: as a container's PID 1, a process without a handler ignores
    # SIGTERM, and `compose down` would wait out the stop grace period before killing it.
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ctx.stop.set)
    bus = await _connect_unless_stopped(settings, run, role, ctx.stop)
    if bus is None:
        log.info("role_stopped_before_connecting", role=role, run=run)
        return 0
    if all(r.name != role for r in bus.config.chain):
        await bus.close()
        why = f" ({entry.why_absent})" if entry.why_absent else ""
        roles = ", ".join(r.name for r in bus.config.chain)
        raise RoleNotInRun(f"run {run} has no {role} role{why}; its roles: {roles}")
    if entry.nodes(bus.config) > 1:
        await _join_nodes(bus, entry.ranks(bus.config), entry.nodes(bus.config))
    forget_credentials()  # after a re-exec under torchrun (which connects again), before any user code
    try:  # the parts of the config this role uses: refused in one line (exit 2) before it does anything
        await asyncio.to_thread(preflight, bus.config, work_dir, entry.checks, f"run {run} ({role})")
    except ConfigError:
        await bus.close()
        raise
    bus.heartbeat_file = heartbeat_file
    ctx.bus = bus
    try:
        await module.serve(ctx)
    finally:
        await bus.close()
    return 0


_PR_SET_DUMPABLE = 4


def hidden_by_launcher() -> list[str]:
    """What the launcher asks every sandbox to mask besides (`SANDBOX_HIDES`: `relax run`'s run dir)."""
    return [p for p in os.environ.get(SANDBOX_HIDES, "").split(os.pathsep) if p]


def make_undumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0): another process of the same uid (reward code outside a sandbox, say) can no
    longer read this one's /proc/<pid>/environ or mem, nor ptrace it; no core dump holds its secrets. Once,
    at role start; a program it executes is dumpable again (its own choice)."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) refused")


def _login_files(settings: ConnectionSettings) -> list[Path]:
    """The files holding this role's credentials: their directories are hidden from reward code."""
    files = (settings.creds_file, settings.nkey_seed_file, settings.tls_key_file)
    return [path.resolve() for path in files if path is not None]


async def _join_nodes(bus: Bus[PipelineConfig], ranks: int, nodes: int) -> None:
    """A role on several nodes started as a plain process becomes this node's torchrun agent (the process
    is replaced); under torchrun already, nothing to do."""
    import torch.distributed

    if torch.distributed.is_torchelastic_launched():
        return
    from workers.roles.torchrun import reexec_under_torchrun

    await bus.close()
    reexec_under_torchrun(bus.config, ranks, nodes)


async def run_worker(
    ctx: RoleContext, worker: Worker[Any], cleanup: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Run a bus worker loop until it ends or the role is told to stop."""
    try:
        await worker.run(stop=ctx.stop)
    finally:
        if cleanup is not None:
            await cleanup()


async def _connect_unless_stopped(
    settings: ConnectionSettings, run: str, role: str, stop: asyncio.Event
) -> Bus[PipelineConfig] | None:
    """The run's bus, retrying for `settings.connect_retry_s`; None if `stop` is set first."""
    connecting = asyncio.create_task(
        Bus.connect(
            settings, run, name=f"relax-{role}", retry_for_s=settings.connect_retry_s, config_model=PipelineConfig
        )
    )
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    await cancel_and_wait(stopping)
    if not connecting.done():
        await cancel_and_wait(connecting)
    if connecting.cancelled() or (stop.is_set() and connecting.exception() is not None):
        return None
    return connecting.result()

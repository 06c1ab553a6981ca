"""The processes of a run on one machine, and following its events: the harness that `relax run`, the
e2e and chaos tests and the pipeline benchmarks share.

`RunProcesses` starts every role of the run's chain as a `relax worker` process (the command lines come
from the role registry: process counts, torchrun ranks), each with its own log file; stops them by PID
in reverse order (SIGTERM, then SIGKILL after a grace period); kills and restarts one on request; asks
them for their stacks (SIGUSR1); and supervises them: a role that exits 0 by itself is finished, one that
exits 2 (`relax_bus.errors.EXIT_REFUSED`: its config cannot work, a restart would fail the same way) ends the
run at once with its error (`RoleRefused`), one that fails otherwise is restarted with backoff (reset once it
has stayed up for `STABLE_S`), and the run fails only when one role fails by itself more than `MAX_RESTARTS`
times with the same exit code and error (or twice as often with any errors) within `RESTART_WINDOW_S` with no
progress of the run in between (a crash loop, as systemd's restart limit and Kubernetes' back-off see it; a
role that keeps failing while the run trains or warms up is recovering each time). A role stopped from outside
(killed by SIGKILL or SIGTERM, which it never sends itself) is restarted with the same backoff and never counts
towards a crash loop; once the run has ended, nothing is restarted or counted.
`follow_events` yields the run's events.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from relax_bus.bus import Bus
from relax_bus.errors import EXIT_REFUSED
from relax_bus.follow import Follower
from relax_bus.ops.server import free_port, log_tail, stop_process
from relax_bus.settings import ConnectionSettings, has_secret
from schemas import Message
from workers.config import PipelineConfig
from workers.errors import RoleRefused, RunFailed
from workers.role_registry import ROLES, role_def
from workers.roles import torchrun

_PREFIX = str(ConnectionSettings.model_config.get("env_prefix", "")).upper()
CONNECTION_VARIABLES = frozenset(f"{_PREFIX}{name.upper()}" for name in ConnectionSettings.model_fields)
"""The RELAX_* variables `ConnectionSettings` reads: how a process connects, and as whom."""
CREDENTIAL_VARIABLES = frozenset(f"{_PREFIX}{n}" for n in ("USER", "TOKEN", "CREDS_FILE", "NKEY_SEED_FILE"))

RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)
MAX_RESTARTS = 5
"""Failures of one role tolerated within `RESTART_WINDOW_S` without progress; one more fails the run."""
RESTART_WINDOW_S = 120.0
STABLE_S = 60.0
"""A role that stayed up this long starts its backoff from the first delay again."""
ERROR_PREFIX = "relax: error: "
"""How `relax worker` starts the line of the error that ended it (`relax_bus.ops.cli.main`)."""
OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
"""Signals that end a process from outside (a person, the OOM killer, a node's shutdown); a role raises none of
them itself. SIGABRT, SIGSEGV and the like are the process's own failure."""


def stopped_from_outside(code: int) -> bool:
    """Whether exit `code` says the role was stopped, not that it failed: killed by one of `OUTSIDE_SIGNALS`, or
    exit 0 (how a role that does not end by itself answers SIGTERM)."""
    return code == 0 or (code < 0 and -code in OUTSIDE_SIGNALS)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


@dataclass
class RoleProcess:
    """One role process, started and stopped by PID."""

    name: str
    index: int
    command: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    """Restarts over the whole run (reported in the summary)."""
    failures: list[tuple[float, str]] = field(default_factory=list)
    """`time.monotonic()` and what it failed with (`failure`) of each of its own failures within the restart
    window (a stop from outside is none)."""
    backoff: int = 0
    """Index into RESTART_BACKOFF_S of the next restart's delay."""
    started_at: float = 0.0
    next_start: float = 0.0
    finished: bool = False
    """Exited 0 by itself, or killed on purpose: not to be restarted."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables added to the inherited environment (its NATS credentials from `relax auth`, say)."""
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return f"{self.name}-{self.index}"

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=self.environment())

    def environment(self) -> dict[str, str] | None:
        """The inherited environment plus `env`; given its own NATS user, none of the launcher's NATS
        settings (its credentials above all) reach the role. None: the launcher's, unchanged."""
        if not self.env:
            return None
        inherited = dict(os.environ)
        if any(k in self.env for k in CREDENTIAL_VARIABLES):
            inherited = {k: v for k, v in inherited.items() if k not in CONNECTION_VARIABLES}
        return {**inherited, **self.env}

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout_s=timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 8) -> str:
        return log_tail(self.log_path, lines)

    def failure(self, code: int) -> str:
        """What it failed with: its exit code and its last error (the last `relax: error: ...` line, else the log's
        last line), numbers masked, so that the same failure again reads the same."""
        lines = [line for line in log_tail(self.log_path, 60).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith(ERROR_PREFIX)]
        last = (errors or lines or [""])[-1]
        return f"{code}: {re.sub(r'[0-9]+', 'N', last)[:300]}"

    def refusal(self) -> str:
        """Why it refused to run: its last `relax: error: ...` and the problem lines after it, else its log's tail."""
        lines = log_tail(self.log_path, 60).splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith(ERROR_PREFIX)]
        if not starts:
            return f"its log ({self.log_path}) ends with:\n{self.log_tail()}"
        return "\n".join(lines[starts[-1] :]).removeprefix(ERROR_PREFIX)


def role_commands(config: PipelineConfig, url: str, work_dir: Path) -> list[tuple[str, int, list[str]]]:
    """The `relax worker` command line of every process the run needs, from the role registry: a role
    with several ranks under torchrun, one on several nodes as one torchrun agent per node, all on this
    machine at one c10d rendezvous (`trainer.distributed.rdzv_endpoint`, or 127.0.0.1 and a free port).

    A URL with a password is left out (any user can read argv): `RunProcesses` hands it to the roles
    as RELAX_NATS_URL in their environment instead."""
    # The role comes first after the module: torchrun hands everything after it to the script.
    args = [
        "worker",
        "{role}",
        "--log-level",
        "info",
        *([] if has_secret(url) else ["--nats-url", url]),
        "--run-id",  # not --run: torchrun's parser would take it for an abbreviation of --run-path
        config.run,
        "--work-dir",
        str(work_dir),
    ]
    out = []
    for entry in ROLES:
        if not entry.enabled(config):
            continue
        role, ranks, nodes = entry.name, entry.ranks(config), entry.nodes(config)
        role_args = [a.format(role=role) for a in args]
        for instance in range(entry.processes(config)):
            # Several nodes on this one machine: one torchrun agent per node, all at one rendezvous.
            endpoint = (config.trainer.distributed.rdzv_endpoint or f"127.0.0.1:{free_port()}") if nodes > 1 else None
            for node in range(nodes):
                cmd = [sys.executable, "-m", "workers.cli", *role_args]
                if ranks > 1 or nodes > 1:
                    cmd = [sys.executable, *torchrun.launcher(config, ranks, nodes, endpoint), "-m", "workers.cli"]
                    cmd += role_args
                out.append((role, instance * nodes + node, cmd))
    return out


class RunProcesses:
    """Every process of one run."""

    def __init__(
        self,
        config: PipelineConfig,
        url: str,
        work_dir: Path,
        log_dir: Path,
        role_env: dict[str, dict[str, str]] | None = None,
        extra: Iterable[tuple[str, int, list[str]]] = (),
    ) -> None:
        """`role_env[name]` is added to that role's environment; `extra` are more (name, index, command)
        processes (rollout workers hosted several per process, say)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        commands = [*role_commands(config, url, work_dir), *extra]
        secret = {"RELAX_NATS_URL": url} if has_secret(url) else {}  # not in argv: see role_commands
        self.roles = [
            RoleProcess(name, i, cmd, log_dir / f"{name}-{i}.log", env={**secret, **(role_env or {}).get(name, {})})
            for name, i, cmd in commands
        ]
        self.progress_at = float("-inf")
        """`time.monotonic()` of the run's last progress (a trained step): failures before it are forgiven."""

    def progressed(self, now: float | None = None) -> None:
        """The run made progress: failures so far no longer count towards a crash loop."""
        self.progress_at = time.monotonic() if now is None else now

    def start(self) -> None:
        for role in self.roles:
            role.start()

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop every process by PID, the last started first."""
        for role in reversed(self.roles):
            role.stop(timeout_s)

    def get(self, name: str, index: int = 0) -> RoleProcess:
        return next(r for r in self.roles if r.name == name and r.index == index)

    def pids(self) -> dict[str, int]:
        return {r.label: r.proc.pid for r in self.roles if r.proc is not None}

    def kill(self, name: str, index: int = 0) -> None:
        """SIGKILL one process by its PID, as a crash would; it stays down until `restart`."""
        role = self.get(name, index)
        assert role.proc is not None and role.proc.poll() is None, f"{role.label} is not running"
        os.kill(role.proc.pid, signal.SIGKILL)
        role.proc.wait(timeout=10)
        role.finished = True

    def restart(self, name: str, index: int = 0) -> None:
        """Start one process again (after a kill or a crash), as a supervisor would."""
        role = self.get(name, index)
        role.stop()
        role.restarts += 1
        role.finished = False
        role.next_start = 0.0
        role.start()

    def dump_stacks(self) -> None:
        """Ask every live role process for its threads' and asyncio tasks' stacks (they go to its log);
        torchrun launchers are left alone (they handle neither SIGUSR1 nor SIGUSR2)."""
        for role in self.roles:
            if role.proc is not None and role.proc.poll() is None and "torch.distributed.run" not in role.command:
                os.kill(role.proc.pid, signal.SIGUSR1)
                os.kill(role.proc.pid, signal.SIGUSR2)

    def failed(self) -> list[tuple[RoleProcess, int]]:
        """Processes that exited with an error and are not yet restarted; marks clean exits finished."""
        out = []
        for role in self.roles:
            if role.finished or role.proc is None or (code := role.proc.poll()) is None:
                continue
            if code == 0 and role_def(role.name).exits_when_done:
                role.finished = True  # ends by itself once the run is done
                continue
            out.append((role, code))
        return out

    def supervise(self, note: Callable[[str], None], now: float | None = None) -> None:
        """Restart failed processes with backoff; RunFailed once one has failed by itself more than `MAX_RESTARTS`
        times with the same error within `RESTART_WINDOW_S` and no progress of the run in between. A role stopped
        from outside (`stopped_from_outside`: SIGKILL, say) is restarted with the same backoff but is no failure.
        Nothing once the run has ended (a role dying then is no failure)."""
        if self.ended():
            return
        now = time.monotonic() if now is None else now
        for role, code in self.failed():
            if code == EXIT_REFUSED:  # its config cannot work: a restart would fail the same way
                raise RoleRefused(f"{role.label} exited with {code} and is not restarted: {role.refusal()}")
            if role.next_start == 0.0:  # a failure not seen yet
                if now - role.started_at >= STABLE_S:
                    role.backoff = 0
                delay = RESTART_BACKOFF_S[min(role.backoff, len(RESTART_BACKOFF_S) - 1)]
                if stopped_from_outside(code):
                    how = "exited 0 unasked" if code == 0 else f"was killed by {_signal_name(code)}"
                    note(f"{role.label} {how} (from outside, not a failure); restart in {delay:g}s")
                else:
                    self._count_failure(role, code, now)
                    note(f"{role.label} exited with {code}; restart in {delay:g}s (log: {role.log_path})")
                role.backoff += 1
                role.next_start = now + delay
            elif now >= role.next_start:
                self.restart(role.name, role.index)
                if role.proc is not None:
                    note(f"{role.label} (pid {role.proc.pid}) restarted, restart {role.restarts}")

    def _count_failure(self, role: RoleProcess, code: int, now: float) -> None:
        """Record one of the role's own failures; RunFailed when it makes a crash loop."""
        failure = role.failure(code)
        recent = [(t, f) for t, f in role.failures if now - t < RESTART_WINDOW_S and t > self.progress_at]
        role.failures = [*recent, (now, failure)]
        same = sum(1 for _, f in role.failures if f == failure)
        if same > MAX_RESTARTS or len(role.failures) > 2 * MAX_RESTARTS:  # the same error, or any errors at all
            what = "with the same error" if same > MAX_RESTARTS else "of its own"
            raise RunFailed(
                f"{role.label} exited with {code}, its {max(same, len(role.failures))}th failure {what} within "
                f"{RESTART_WINDOW_S:g}s without the run making progress ({role.restarts} restarts in all); "
                f"its log ({role.log_path}) ends with:\n{role.log_tail()}"
            )

    def ended(self) -> bool:
        """Whether the run is over: a role that ends the run exited by itself."""
        return any(role_def(r.name).ends_run and r.finished for r in self.roles)


async def follow_events(bus: Bus[Any], idle_s: float = 0.5) -> AsyncIterator[Message | None]:
    """The run's events from the start, decoded; None after `idle_s` without one (a chance to look around).

    Read by the bus's `Follower` in stream order (an event that does not decode is passed over). Iterate it
    inside `contextlib.aclosing(...)`, so that leaving the loop early closes the follower at once."""
    async with Follower.ordered(bus, "events").reading() as follower:
        while True:
            batch = await follower.next_batch(idle_s)
            if not batch:
                yield None
            for _, event in batch:
                if event is not None:
                    yield event

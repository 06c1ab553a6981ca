"""The base of every loop the bus runs for a role: its heartbeat, its stop and its signals.

Four shapes derive from `Loop`: the per-message `Worker` (`relax_bus.worker`), the `BatchWorker` (the
trainer's steps, `relax_bus.batch_worker`), the `Source` (publishes, consumes nothing: the feeder,
`relax_bus.source`) and the `Follower` (reads a limits stream in order: the metrics role, `relax run`'s
progress, the feeder's dead-letter credit, `relax_bus.follow`). What they share lives here:

- the heartbeat: the loop's entry `<role>.<worker id>` in the run's workers bucket, rewritten every third
  of the bucket's TTL with the loop's `counters` (and the role's own `counts`) and the `policy_version`
  the role says it works with, and mirrored into the bus's `heartbeat_file` when it has one (the container
  probes, `relax_bus.probe`). `run` keeps it for as long as the loop runs; `alive()` starts it earlier,
  for a role whose setup takes long (a trainer's warm-up). A loop that runs for no role (a follower
  inside another role's process, or the launcher's) keeps none: its process beats for itself;
- the log context: while the heartbeat runs, every log event of the loop (and of the role's code it calls)
  carries `run`, `role` and `worker`, the loop's worker id (`relax_bus.log.bound`);
- stopping: `stop()` asks the loop to wind down, and `run(stop=event)` does so when the role's stop event
  is set (SIGTERM in `relax worker`), the one way a role runs its loop until told; with
  `handle_signals`, SIGTERM and SIGINT stop it directly.

Subscriptions, the keep-alive of unsettled messages, the reaper and settling belong to the shapes that
consume; each shape's `run` wraps its own loop in `running(...)`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import asdict

from relax_bus import log
from relax_bus.bus import JS_TIMEOUT_S, Bus
from relax_bus.cancel import cancel_and_wait
from relax_bus.delivery import Counters, WorkerOptions
from relax_bus.heartbeat import HeartbeatWriter, process_heartbeat
from relax_bus.outage import through_outage
from relax_bus.probe import ProbeFile
from schemas import WorkerHeartbeat

SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What stops a loop run with `handle_signals`."""


class Loop:
    """Heartbeat, stop and signals of one loop of the bus; a shape's `run` supplies the loop itself."""

    def __init__(self, bus: Bus, role: str | None, options: WorkerOptions | None = None) -> None:
        self.bus = bus
        self.options = options or WorkerOptions()
        self.counters = Counters()
        """What the loop has done since it started; written into its heartbeat."""
        self.counts: collections.Counter[str] = collections.Counter()
        """The role's own counts, written into the heartbeat beside `counters` (what each sink wrote, say)."""
        self.policy_version: int | None = None
        """The policy version the role works with, as its heartbeat reports it (the role keeps it current)."""
        self.started_at = time.time()
        self.beats_as = role
        """The role whose heartbeat this loop writes (None: none, its process beats for itself)."""
        self._stop = asyncio.Event()
        self._heartbeat: HeartbeatWriter | None = None
        if role is not None:
            ttl_s = bus.config.bus.heartbeat_ttl_s
            every_s = ttl_s / 3 + JS_TIMEOUT_S  # a put waits this long for a server that is away
            probe = ProbeFile(bus.heartbeat_file, ttl_s, every_s) if bus.heartbeat_file is not None else None
            key = f"{role}.{self.worker_id}"
            self._heartbeat = HeartbeatWriter(bus.workers, key, self._beat, ttl_s / 3, probe)

    @property
    def worker_id(self) -> str:
        return self.options.worker_id

    @property
    def stopping(self) -> bool:
        """Whether the loop was asked to stop."""
        return self._stop.is_set()

    def stop(self) -> None:
        """Ask the loop to wind down (what SIGTERM does)."""
        self._stop.set()

    def _beat(self) -> WorkerHeartbeat:
        assert self.beats_as is not None
        counters = {**asdict(self.counters), **self.counts}
        return process_heartbeat(
            self.bus.run, self.beats_as, self.worker_id, self.started_at, self.policy_version, counters
        )

    @contextlib.asynccontextmanager
    async def alive(self) -> AsyncIterator[None]:
        """Heartbeat from now until the block ends; the entry is removed then, so the worker vanishes at once.
        Nested blocks beat once: the outermost starts and ends it."""
        heartbeat = self._heartbeat
        starts = heartbeat is not None and not heartbeat.running
        if heartbeat is not None and starts:
            await through_outage(heartbeat.beat, "write the first heartbeat")  # idempotent: a KV put of our own key
            heartbeat.start()
        try:
            with self.log_context():
                yield
        finally:
            if heartbeat is not None and starts:
                await heartbeat.stop(remove=True)

    def log_context(self) -> contextlib.AbstractContextManager[None]:
        """`run`, `role` and `worker` (this loop's id) on every log event of the block, for a loop that runs for a
        role; nothing for one that does not (its process's role says whose its events are)."""
        if self.beats_as is None:
            return contextlib.nullcontext()
        return log.bound(run=self.bus.run, role=self.beats_as, worker=self.worker_id)

    @contextlib.asynccontextmanager
    async def running(self, *, stop: asyncio.Event | None = None, handle_signals: bool = False) -> AsyncIterator[None]:
        """What surrounds every shape's loop: the heartbeat, `stop` watched (set: the loop is stopped as by
        `stop()`), and with `handle_signals` SIGTERM/SIGINT doing the same."""
        loop = asyncio.get_running_loop()
        if handle_signals:
            for sig in SIGNALS:
                loop.add_signal_handler(sig, self.stop)
        told = asyncio.create_task(self._stop_when(stop), name="stop-when-told") if stop is not None else None
        try:
            async with self.alive():
                yield
        finally:
            if told is not None:
                await cancel_and_wait(told)
            if handle_signals:
                for sig in SIGNALS:
                    loop.remove_signal_handler(sig)

    async def _stop_when(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.stop()

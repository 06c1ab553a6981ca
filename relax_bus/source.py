"""The source shape of the worker loop: a role that publishes without consuming (the feeder).

The role's `produce()` says what may be published now: messages for the role's output subject, an
empty list (nothing yet), or None (the source is done). The bus publishes them, deduplicated by their
message ids, so a batch whose acks were lost is published again with the same ids and stored once;
then it calls `published(batch)` (the role's own bookkeeping, such as a cursor). When nothing was
produced, or the output hop is full, it waits for the role's `wake` event (set by a KV watch, say)
or `poll_s`, whichever comes first. It keeps a heartbeat, and stops on `stop()` (what SIGTERM does, or the
role's stop event given to `run`), at once even while a publish waits for room in a full hop; the heartbeat and
the stop come from the loop base (`relax_bus.loop`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict
from typing import Protocol

from relax_bus.bus import Bus
from relax_bus.cancel import cancel_and_wait
from relax_bus.delivery import Counters, WorkerOptions
from relax_bus.errors import PublishFailed
from relax_bus.log import get_logger
from relax_bus.loop import Loop
from schemas import Message

log = get_logger(__name__)


class SourceRole(Protocol):
    """What a source role supplies; the bus owns publishing, waiting, the heartbeat and shutdown."""

    wake: asyncio.Event
    """Set when producing may give something new (the policy version moved, say)."""

    async def produce(self) -> Sequence[Message] | None:
        """What to publish now; [] for nothing yet, None when the source is done."""

    async def published(self, batch: Sequence[Message]) -> None:
        """Called once `batch` (what `produce` returned) is stored in the output stream."""


class Source(Loop):
    """Runs a `SourceRole` for one role of a run."""

    def __init__(
        self,
        bus: Bus,
        role: str,
        source_role: SourceRole,
        options: WorkerOptions | None = None,
        poll_s: float = 0.2,
        publish_deadline_s: float = 30.0,
    ) -> None:
        super().__init__(bus, role, options)
        self.role = bus.topology.role(role)
        if self.role.output is None or self.role.input is not None:
            raise ValueError(f"role {role!r} is not a source (it must publish and consume nothing)")
        self.subject = bus.topology.subject(self.role.output)
        self.source_role = source_role
        self.poll_s = poll_s
        self.publish_deadline_s = publish_deadline_s

    def stop(self) -> None:
        """Stop producing; a publish in flight is abandoned (its ids deduplicate it when published again)."""
        super().stop()

    async def run(self, *, stop: asyncio.Event | None = None, handle_signals: bool = False) -> Counters:
        """Produce and publish until the role is done or stopped (`stop()`, `stop` set, a signal with
        `handle_signals`)."""
        async with self.running(stop=stop, handle_signals=handle_signals):
            log.info("source_started", role=self.role.name, worker=self.worker_id, subject=self.subject)
            while not self._stop.is_set():
                batch = await self.source_role.produce()
                if batch is None:
                    break
                if not batch:
                    await self._wait()
                    continue
                try:
                    if not await self._publish_unless_stopped(batch):
                        break
                except PublishFailed as err:
                    # Tolerated: the output hop is full (back-pressure) or NATS is away; `produce` gives the
                    # same messages again (its bookkeeping did not move) and their ids deduplicate them.
                    self.counters.output_full += 1
                    log.info("source_waiting", role=self.role.name, reason=str(err))
                    continue
                self.counters.published += len(batch)
                await self.source_role.published(batch)
        log.info("source_stopped", role=self.role.name, **asdict(self.counters))
        return self.counters

    async def _publish_unless_stopped(self, batch: Sequence[Message]) -> bool:
        """Publish the batch; False when the source was stopped first (a publish held back by a full hop is
        abandoned: nothing was recorded, and the ids deduplicate whatever of it was stored)."""
        publish = asyncio.create_task(
            self.bus.publisher.publish_many([(self.subject, m) for m in batch], deadline_s=self.publish_deadline_s)
        )
        stopped = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait([publish, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if publish.done():
            publish.result()  # PublishFailed propagates to the caller
            return True
        await cancel_and_wait(publish)
        return False

    async def _wait(self) -> None:
        """Until stopped, woken by the role, or `poll_s` passes."""
        wake = self.source_role.wake
        wake.clear()
        waits = [asyncio.create_task(self._stop.wait()), asyncio.create_task(wake.wait())]
        await asyncio.wait(waits, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()

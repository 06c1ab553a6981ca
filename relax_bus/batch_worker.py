"""The batch shape of the worker loop: hold up to B admitted messages, handle them once, settle them together.

For a role whose unit of work is a batch (the trainer's step). Per message the bus decodes it (an
undecodable one is dead-lettered) and asks the role's `admit(message, delivery, held)`, which may
raise the control exceptions: they are settled where the worker loop settles everything
(`Worker._settle`): `Skip` acks (a copy already handled), `Drop` terminates with the reason (a stale
group), `Reject` dead-letters. Returning holds the message for the batch; held messages are kept alive
until settled. With B held, `handle(batch)` runs once; then every held message is acked, all acks in
flight together; then `settled(batch)` runs (what must follow the acks: step records, checkpoints).
A stop, or a failing `handle`, hands the held messages back (nak) for redelivery.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, cast

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from relax_bus.bus import Bus
from relax_bus.delivery import Counters, Delivery, In, WorkerOptions
from relax_bus.envelope import open_message
from relax_bus.errors import BlobCorrupt, BlobNotFound, NatsUnavailable
from relax_bus.fetch import fetch_at_most
from relax_bus.log import get_logger
from relax_bus.outage import through_outage
from relax_bus.worker import Worker, quietly
from schemas import SchemaError

log = get_logger(__name__)

ACK_OUTAGE_S = 15.0
"""How long the ack of a handled message is retried through an outage; past that its redelivery is
the role's to recognise (`admit` raising `Skip`)."""


@dataclass(frozen=True)
class Held(Generic[In]):
    """One admitted message of the batch being collected."""

    message: In
    delivery: Delivery
    msg: Msg


class BatchRole(Protocol[In]):
    """What a batch role supplies; the bus owns fetching, settling, keep-alive and shutdown."""

    async def admit(self, message: In, delivery: Delivery, held: Sequence[Held[In]]) -> None:
        """Return to hold the message for the batch; raise `Skip` / `Drop` / `Reject` to settle it now."""

    async def handle(self, batch: Sequence[Held[In]]) -> None:
        """Handle a full batch; every message of it is acked when this returns."""

    async def settled(self, batch: Sequence[Held[In]]) -> None:
        """After the batch's acks (records that must follow them); may call `BatchWorker.stop`."""


class BatchWorker(Worker[In]):
    """Runs a `BatchRole` against its role's durable consumer, `size()` messages per batch."""

    def __init__(
        self,
        bus: Bus,
        role: str,
        batch_role: BatchRole[In],
        input_type: type[In],
        size: Callable[[], int],
        options: WorkerOptions | None = None,
    ) -> None:
        super().__init__(bus, role, _no_handler, input_type, options)
        self.batch_role = batch_role
        self.size = size
        self.timings: collections.defaultdict[str, float] = collections.defaultdict(float)
        """Seconds spent waiting for data, admitting and acking, since the role last reset it."""

    async def run(self, *, until_empty: bool = False, handle_signals: bool = False) -> Counters:
        """Collect, handle and settle batches until stopped (`until_empty` has no meaning here: a batch
        role waits for a whole batch)."""
        if until_empty:
            raise ValueError("a BatchWorker runs until stopped; until_empty is for per-message workers")
        async with self._running(handle_signals) as sub:
            while not self._stop.is_set():
                held: list[Held[In]] = []
                try:
                    if not await self._collect(sub, held):
                        break
                    await self.batch_role.handle(held)
                except BaseException:
                    await asyncio.gather(*(quietly(h.msg.nak()) for h in held))  # back for redelivery
                    raise
                finally:
                    for h in held:
                        self._working.pop(id(h.msg), None)
                started = time.perf_counter()
                await asyncio.gather(*(self._ack(h.msg) for h in held))
                self.timings["ack_s"] += time.perf_counter() - started
                self.counters.processed += len(held)
                await self.batch_role.settled(held)
        return self.counters

    async def _collect(self, sub: JetStreamContext.PullSubscription, held: list[Held[In]]) -> bool:
        """Fill `held` with a batch; False when stopped first (the held messages are then handed back)."""
        started = time.perf_counter()
        while len(held) < (need := self.size()):
            if self._stop.is_set():
                await asyncio.gather(*(quietly(h.msg.nak()) for h in held))
                return False
            for msg in await fetch_at_most(sub, need - len(held), self.options.fetch_timeout_s):
                admit_started = time.perf_counter()
                item = await self._admit(msg, held)
                self.timings["admit_s"] += time.perf_counter() - admit_started
                if item is not None:
                    held.append(item)
        self.timings["data_wait_s"] += time.perf_counter() - started
        return True

    async def _admit(self, msg: Msg, held: list[Held[In]]) -> Held[In] | None:
        delivery = self._delivery(msg)
        self.counters.received += 1
        self._working[id(msg)] = msg  # kept alive from delivery until settled
        if (foreign := self._foreign(msg)) is not None:
            self._working.pop(id(msg), None)
            await self._dead_letter(msg, delivery, foreign)
            return None
        try:
            message = cast(In, await open_message(msg.data, msg.headers, self.bus.media, self.input_type))
        except (SchemaError, BlobNotFound, BlobCorrupt) as err:
            self._working.pop(id(msg), None)
            await self._dead_letter(msg, delivery, f"undecodable {self.stream.key} message: {err}")
            return None
        try:
            await self.batch_role.admit(message, delivery, held)
        except asyncio.CancelledError:
            self._working.pop(id(msg), None)
            await quietly(msg.nak())
            raise
        except BaseException as err:  # every outcome is settled in one place
            self._working.pop(id(msg), None)
            await self._settle(msg, delivery, message, err)
            return None
        return Held(message, delivery, msg)

    async def _ack(self, msg: Msg) -> None:
        try:
            await through_outage(msg.ack_sync, "ack a handled message", deadline_s=ACK_OUTAGE_S)
        except NatsUnavailable:
            pass  # tolerated: an ack lost with a server restart brings the message back; `admit` skips it


async def _no_handler(message: object, delivery: Delivery) -> None:
    raise AssertionError("a BatchWorker calls its BatchRole, never a per-message handler")

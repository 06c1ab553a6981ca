"""The follower shape of the bus's loop: a limits stream (events, dlq) read in stream order.

Reading a limits stream takes nothing away from it: `relax run`, `relax inspect` and every other follower
see the same messages. A follower hands them out in batches, in order, each once, decoded (claim checks
resolved; a message that does not decode, or that is stored under a subject other than the stream's, is
handed out as None: these streams are informative, and one bad entry must not stop the reader). It reads
from one of two consumers:

- `Follower.for_role(bus, role, handle)`: the role's own durable consumer (the metrics role). On open the
  durable is rewound to just after its ack floor (`relax_bus.rewind`), so what was delivered to a process
  that died before acknowledging it comes again at once and in order; a batch is acknowledged only after
  the role's `handle(batch)` returns (its sinks have the batch), and one seen before (a redelivery within
  this process) is acknowledged and handed out no more. It heartbeats as the role.
- `Follower.ordered(bus, stream_key, from_seq=...)`: an ephemeral ordered consumer starting at a stream
  sequence, with no acks (`relax run`'s progress, the feeder's dead-letter credit, which counts the same
  letters again after a restart). It keeps no heartbeat: the process it runs in beats for itself. Given a
  `reconnected` event (set when the connection came back after an outage), it subscribes again at once
  from the message after the last one it received, instead of waiting for the ordered consumer to notice
  its missed heartbeats.

`run(stop=...)` reads and hands batches to `handle` until stopped; a reader that drives itself (an async
generator) uses `reading()` and `next_batch()` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any, NamedTuple

import nats.errors
from nats.aio.msg import Msg
from nats.js import api

from relax_bus.bus import Bus
from relax_bus.delivery import Counters, WorkerOptions, foreign_subject
from relax_bus.envelope import open_message
from relax_bus.errors import BlobCorrupt, BlobNotFound
from relax_bus.fetch import fetch_at_most
from relax_bus.log import get_logger
from relax_bus.loop import Loop
from relax_bus.outage import through_outage
from relax_bus.rewind import rewind_durable
from schemas import Message, SchemaError

log = get_logger(__name__)

BATCH = 64
"""Most messages handed out at once."""


class Followed(NamedTuple):
    """One message of a followed stream."""

    seq: int
    """Its stream sequence."""
    message: Message | None
    """What it decodes to (None: not a message this code reads)."""


FollowHandler = Callable[[list[Followed]], Awaitable[None]]
"""What a follower role supplies: takes a batch; the durable's acks follow its return."""


class Follower(Loop):
    """Reads one limits stream in order, from a role's durable or from an ordered consumer."""

    def __init__(
        self,
        bus: Bus,
        stream_key: str,
        handle: FollowHandler | None = None,
        *,
        role: str | None = None,
        from_seq: int = 1,
        reconnected: asyncio.Event | None = None,
        batch: int = BATCH,
        options: WorkerOptions | None = None,
    ) -> None:
        super().__init__(bus, role, options)
        self.stream = bus.topology.stream(stream_key)
        self.handle = handle
        self.durable = bus.topology.consumer(stream_key).durable if role is not None else None
        """The role's durable consumer (None: an ordered consumer, no acks)."""
        self.batch = batch
        self.last_seq = from_seq - 1
        """Stream sequence of the last message handed out."""
        self.reconnected = reconnected
        self._sub: Any = None
        self._unacked: list[Msg] = []
        """Messages handed out from the durable and not yet acknowledged."""
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        """What the ordered consumer delivered, not yet handed out."""
        self._received_seq = self.last_seq
        """Stream sequence of the last message the ordered consumer delivered."""

    @classmethod
    def for_role(
        cls,
        bus: Bus,
        role: str,
        handle: FollowHandler | None = None,
        *,
        batch: int = BATCH,
        options: WorkerOptions | None = None,
    ) -> Follower:
        """A follower of `role`'s input stream through the role's durable (rewound to its ack floor, acked per
        batch once `handle` returns), heartbeating as the role."""
        key = bus.topology.role(role).input
        if key is None:
            raise ValueError(f"role {role!r} has no input stream to follow")
        return cls(bus, key, handle, role=role, batch=batch, options=options)

    @classmethod
    def ordered(
        cls,
        bus: Bus,
        stream_key: str,
        handle: FollowHandler | None = None,
        *,
        from_seq: int = 1,
        reconnected: asyncio.Event | None = None,
        batch: int = BATCH,
        options: WorkerOptions | None = None,
    ) -> Follower:
        """A follower of a stream through an ordered consumer from `from_seq` (no acks, no heartbeat)."""
        return cls(bus, stream_key, handle, from_seq=from_seq, reconnected=reconnected, batch=batch, options=options)

    # ---- opening and closing ------------------------------------------------------------------------------

    async def open(self) -> None:
        """Subscribe (a durable is first rewound to just after its ack floor)."""
        if self.durable is not None:
            start = await rewind_durable(self.bus, self.stream.name, self.durable)
            self._sub = await self.bus.js.pull_subscribe_bind(self.durable, self.stream.name)
        else:
            start = self._received_seq + 1
            self._sub = await self._subscribe(start)
        log.info("follower_opened", stream=self.stream.name, durable=self.durable, from_seq=start)

    async def _subscribe(self, start: int) -> Any:
        # The stream named outright: looking it up by subject needs a permission roles do not have.
        config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
        return await self.bus.js.subscribe(
            self.stream.subject, stream=self.stream.name, ordered_consumer=True, cb=self._delivered, config=config
        )

    async def _delivered(self, msg: Msg) -> None:
        self._received_seq = max(self._received_seq, msg.metadata.sequence.stream)
        await self._queue.put(msg)

    async def close(self) -> None:
        """Unsubscribe (what was handed out and not acknowledged comes again to the durable's next reader)."""
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass  # tolerated: the subscription died with the connection

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[Follower]:
        """Open (unless it is already) for the block, closed after it."""
        if self._sub is None:
            await self.open()
        try:
            yield self
        finally:
            await self.close()

    # ---- reading ---------------------------------------------------------------------------------------

    async def next_batch(self, timeout_s: float | None = None) -> list[Followed]:
        """The next messages in stream order, each once; [] when none came within `timeout_s` (default: the
        options' fetch timeout), when NATS is away or when the follower was stopped meanwhile."""
        assert self._sub is not None, "open() first"
        timeout_s = self.options.fetch_timeout_s if timeout_s is None else timeout_s
        msgs = await (self._pull(timeout_s) if self.durable is not None else self._delivered_batch(timeout_s))
        out = []
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            if seq <= self.last_seq:
                if self.durable is not None:
                    await msg.ack()  # a redelivery of what this process handed out already
                continue  # (an ordered consumer: what an old and a new subscription both delivered)
            self.last_seq = seq
            if self.durable is not None:
                self._unacked.append(msg)
            out.append(Followed(seq, await self._decode(msg)))
        self.counters.received += len(out)
        return out

    async def _pull(self, timeout_s: float) -> list[Msg]:
        # Everything that came is kept: a surplus handed back could come again behind newer messages.
        return await fetch_at_most(self._sub, self.batch, timeout_s, keep_surplus=True)

    async def _delivered_batch(self, timeout_s: float) -> list[Msg]:
        """What the ordered consumer delivered: waits up to `timeout_s` for the first, then takes what is there."""
        if self.reconnected is not None and self.reconnected.is_set():
            self.reconnected.clear()
            await self.close()
            self._sub = await self._subscribe(self._received_seq + 1)
        if self._queue.empty():
            getting = asyncio.ensure_future(self._queue.get())
            stopping = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({getting, stopping}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not getting.done():
                getting.cancel()  # cancelling a waiting `Queue.get` loses nothing
                return []
            msgs = [getting.result()]
        else:
            msgs = []
        while len(msgs) < self.batch and not self._queue.empty():
            msgs.append(self._queue.get_nowait())
        return msgs

    async def _decode(self, msg: Msg) -> Message | None:
        if (foreign := foreign_subject(msg.subject, self.stream)) is not None:
            log.warning("followed_message_foreign", seq=msg.metadata.sequence.stream, why=foreign)
            return None
        try:
            return await through_outage(
                lambda: open_message(msg.data, msg.headers, self.bus.media), f"read a {self.stream.key} message"
            )
        except (SchemaError, BlobNotFound, BlobCorrupt) as err:
            # Tolerated: the stream is informative; an unreadable message is logged and passed over.
            log.warning("followed_message_unreadable", seq=msg.metadata.sequence.stream, error=str(err))
            return None

    async def acknowledge(self) -> None:
        """Acknowledge every message handed out so far (the role is done with them); nothing to do for an ordered
        consumer."""
        msgs, self._unacked = self._unacked, []
        for msg in msgs:
            await msg.ack()

    # ---- the loop ----------------------------------------------------------------------------------------

    async def run(self, *, stop: asyncio.Event | None = None, handle_signals: bool = False) -> Counters:
        """Hand batches to `handle` (then acknowledge them) until stopped; the batch in hand is handled first."""
        if self.handle is None:
            raise ValueError("a follower runs a handler; one without reads with reading() and next_batch()")
        async with self.running(stop=stop, handle_signals=handle_signals), self.reading():
            while not self._stop.is_set():
                batch = await self.next_batch()
                if not batch:
                    continue
                await self.handle(batch)
                await self.acknowledge()
                self.counters.processed += len(batch)
        log.info("follower_stopped", stream=self.stream.name, durable=self.durable, **asdict(self.counters))
        return self.counters

"""The follower shape of the bus's loop: a limits stream (events, dlq) read in stream order.

Reading a limits stream takes nothing away from it: `relax run`, `relax inspect` and every other follower
see the same messages. A follower hands them out in batches, in order, each once, decoded (claim checks
resolved; a message that does not decode, or that is stored under a subject other than the stream's, is
handed out as None: these streams are informative, and one bad entry must not stop the reader). It reads
in one of two ways:

- `Follower.for_role(bus, role, handle)`: the role's own durable consumer (the metrics role). On open the
  durable is rewound to just after its ack floor (`relax_bus.rewind`), so what was delivered to a process
  that died before acknowledging it comes again at once and in order; a batch is acknowledged only after
  the role's `handle(batch)` returns (its sinks have the batch), and one seen before (a redelivery within
  this process) is acknowledged and handed out no more. It heartbeats as the role.
- `Follower.ordered(bus, stream_key, from_seq=...)`: reads by direct get from a stream sequence on, with no
  acks and no consumer (`relax run`'s progress, the feeder's dead-letter credit, which counts the same
  letters again after a restart; roles create no consumers, `relax_bus.direct_get`). It asks again every
  `POLL_S` while nothing new is stored, and keeps no heartbeat: the process it runs in beats for itself.

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

from relax_bus.bus import Bus
from relax_bus.delivery import Counters, WorkerOptions, foreign_subject
from relax_bus.direct_get import read_batch
from relax_bus.envelope import open_message
from relax_bus.errors import BlobCorrupt, BlobNotFound
from relax_bus.fetch import fetch_at_most
from relax_bus.log import get_logger
from relax_bus.loop import Loop
from relax_bus.outage import is_transient, through_outage
from relax_bus.rewind import rewind_durable
from schemas import Message, SchemaError

log = get_logger(__name__)

BATCH = 64
"""Most messages handed out at once."""
POLL_S = 0.25
"""How often an ordered follower asks again while nothing new is stored."""


class Followed(NamedTuple):
    """One message of a followed stream."""

    seq: int
    """Its stream sequence."""
    message: Message | None
    """What it decodes to (None: not a message this code reads)."""


FollowHandler = Callable[[list[Followed]], Awaitable[None]]
"""What a follower role supplies: takes a batch; the durable's acks follow its return."""


class Follower(Loop):
    """Reads one limits stream in order, from a role's durable or by direct get."""

    def __init__(
        self,
        bus: Bus,
        stream_key: str,
        handle: FollowHandler | None = None,
        *,
        role: str | None = None,
        from_seq: int = 1,
        batch: int = BATCH,
        options: WorkerOptions | None = None,
    ) -> None:
        super().__init__(bus, role, options)
        self.stream = bus.topology.stream(stream_key)
        self.handle = handle
        self.durable = bus.topology.consumer(stream_key).durable if role is not None else None
        """The role's durable consumer (None: read by direct get, no acks)."""
        self.batch = batch
        self.last_seq = from_seq - 1
        """Stream sequence of the last message handed out."""
        self._sub: Any = None
        self._open = False
        self._unacked: list[Msg] = []
        """Messages handed out from the durable and not yet acknowledged."""

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
        batch: int = BATCH,
        options: WorkerOptions | None = None,
    ) -> Follower:
        """A follower of a stream by direct get from `from_seq` (no consumer, no acks, no heartbeat)."""
        return cls(bus, stream_key, handle, from_seq=from_seq, batch=batch, options=options)

    # ---- opening and closing ------------------------------------------------------------------------------

    async def open(self) -> None:
        """Bind to the durable, rewound first to just after its ack floor (nothing to open for an ordered one)."""
        if self.durable is not None:
            start = await rewind_durable(self.bus, self.stream.name, self.durable)
            self._sub = await self.bus.js.pull_subscribe_bind(self.durable, self.stream.name)
        else:
            start = self.last_seq + 1
        self._open = True
        log.info("follower_opened", stream=self.stream.name, durable=self.durable, from_seq=start)

    async def close(self) -> None:
        """Unsubscribe (what was handed out and not acknowledged comes again to the durable's next reader)."""
        sub, self._sub, self._open = self._sub, None, False
        if sub is not None:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass  # tolerated: the subscription died with the connection

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[Follower]:
        """Open (unless it is already) for the block, closed after it."""
        if not self._open:
            await self.open()
        try:
            yield self
        finally:
            await self.close()

    # ---- reading ---------------------------------------------------------------------------------------

    async def next_batch(self, timeout_s: float | None = None) -> list[Followed]:
        """The next messages in stream order, each once; [] when none came within `timeout_s` (default: the
        options' fetch timeout), when NATS is away or when the follower was stopped meanwhile."""
        assert self._open, "open() first"
        timeout_s = self.options.fetch_timeout_s if timeout_s is None else timeout_s
        if self.durable is None:
            return await self._stored_batch(timeout_s)
        out = []
        for msg in await fetch_at_most(self._sub, self.batch, timeout_s, keep_surplus=True):
            # Everything that came is kept: a surplus handed back could come again behind newer messages.
            seq = msg.metadata.sequence.stream
            if seq <= self.last_seq:
                await msg.ack()  # a redelivery of what this process handed out already
                continue
            self.last_seq = seq
            self._unacked.append(msg)
            out.append(Followed(seq, await self._decode(msg.subject, seq, msg.data, msg.headers)))
        self.counters.received += len(out)
        return out

    async def _stored_batch(self, timeout_s: float) -> list[Followed]:
        """The messages stored after the last one handed out: asks every `POLL_S` until some are or `timeout_s`
        passed (or the follower was stopped)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                stored = [
                    m
                    async for m in read_batch(
                        self.bus.nc, self.stream.name, self.stream.subject, from_seq=self.last_seq + 1, batch=self.batch
                    )
                ]
            except (nats.errors.Error, OSError) as err:
                if not is_transient(err):
                    raise
                stored = []  # tolerated: NATS is away; asked again below
            if stored:
                break
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0 or self._stop.is_set():
                return []
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), min(POLL_S, left))
        out = []
        for m in stored:
            self.last_seq = m.seq
            out.append(Followed(m.seq, await self._decode(m.subject, m.seq, m.data, m.headers)))
        self.counters.received += len(out)
        return out

    async def _decode(self, subject: str, seq: int, data: bytes, headers: dict[str, str] | None) -> Message | None:
        if (foreign := foreign_subject(subject, self.stream)) is not None:
            log.warning("followed_message_foreign", seq=seq, why=foreign)
            return None
        try:
            return await through_outage(
                lambda: open_message(data, headers, self.bus.media), f"read a {self.stream.key} message"
            )
        except (SchemaError, BlobNotFound, BlobCorrupt) as err:
            # Tolerated: the stream is informative; an unreadable message is logged and passed over.
            log.warning("followed_message_unreadable", seq=seq, error=str(err))
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

"""Reading a run's events in stream order from a role's durable consumer on the events stream.

The events stream is limits-retention: reading it takes nothing away from `relax run`, `relax inspect`
or anyone else following it. On open the durable is rewound to just after its ack floor, so events
delivered to a process that died before acknowledging them come again at once and in order (not after
`ack_wait`, behind newer ones). A message is acknowledged only when the caller says its batch is
written; one seen before (a redelivery within this process) is handed out no more.
"""

from __future__ import annotations

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from relax_bus.bus import Bus
from relax_bus.envelope import open_message
from relax_bus.errors import BlobCorrupt, BlobNotFound
from relax_bus.fetch import fetch_at_most
from relax_bus.log import get_logger
from relax_bus.outage import through_outage
from schemas import Message, SchemaError

log = get_logger(__name__)

Batch = list[tuple[Msg, Message | None]]
"""Delivered messages with what they decode to (None: not a message this code reads)."""


class EventReader:
    """The events, in order, from the durable consumer of `role` (whose input is the events stream)."""

    def __init__(self, bus: Bus, role: str, batch: int = 64, fetch_timeout_s: float = 1.0) -> None:
        key = bus.topology.role(role).input
        if key is None:
            raise ValueError(f"role {role!r} has no input stream to read events from")
        self.bus = bus
        self.stream = bus.topology.stream(key).name
        self.durable = bus.topology.consumer(key).durable
        self.batch = batch
        self.fetch_timeout_s = fetch_timeout_s
        self.last_seq = 0
        self._sub: JetStreamContext.PullSubscription | None = None

    async def open(self) -> None:
        """Rewind the durable to its ack floor and subscribe to it."""
        js = self.bus.js
        info = await through_outage(lambda: js.consumer_info(self.stream, self.durable), "read the events consumer")
        floor = int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0
        await through_outage(
            lambda: js.reset_consumer(self.stream, self.durable, seq=floor + 1), "rewind the events consumer"
        )
        self._sub = await js.pull_subscribe_bind(self.durable, self.stream)
        log.info("events_reader_opened", stream=self.stream, durable=self.durable, from_seq=floor + 1)

    async def next_batch(self) -> Batch:
        """The next messages in stream order; [] when none came within the fetch timeout (or NATS is away)."""
        assert self._sub is not None, "open() first"
        out: Batch = []
        for msg in await fetch_at_most(self._sub, self.batch, self.fetch_timeout_s, keep_surplus=True):
            seq = msg.metadata.sequence.stream
            if seq <= self.last_seq:
                await msg.ack()  # a redelivery of what this process already wrote
                continue
            self.last_seq = seq
            out.append((msg, await self._decode(msg)))
        return out

    async def _decode(self, msg: Msg) -> Message | None:
        try:
            return await open_message(msg.data, msg.headers, self.bus.media)
        except (SchemaError, BlobNotFound, BlobCorrupt) as err:
            # Tolerated: an event is informative; an unreadable one is logged and passed over.
            log.warning("event_unreadable", seq=msg.metadata.sequence.stream, error=str(err))
            return None

    async def ack(self, batch: Batch) -> None:
        """Acknowledge a batch whose events every sink has written."""
        for msg, _ in batch:
            await msg.ack()

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except nats.errors.Error:
                pass  # tolerated: the subscription died with the connection
            self._sub = None

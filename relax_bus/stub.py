"""A stub bus: a `Bus` whose connection, publisher, object stores and KV buckets live in memory.

For unit tests of handlers, without a nats-server (dramatiq's `StubBroker`). `StubBus.of(config)` is a
real `Bus`: the run's real topology, `bus.publish`, `bus.state`, `bus.media` and `bus.version` as a
handler uses them. `deliver` hands one message to a real `Worker` through the loop's own per-message
path (`Worker._handle`: decode, call, publish the outputs, settle), so the ack / drop / retry /
dead-letter decision is the loop's `_settle`, not a copy of it. What a test gets back is how the message
was settled and what its handling published.

What it leaves out: fetching, heartbeats, keep-alive, reaping, watches, and the server's limits (a hop
never fills). Publishes are deduplicated by message id, as the server's duplicate window does.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, cast

import nats.js.errors
from nats.js import api
from nats.js.kv import KeyValue

from relax_bus.bus import Bus
from relax_bus.envelope import MSG_ID, message_id
from relax_bus.errors import BlobNotFound
from relax_bus.policy_version import PolicyVersion
from relax_bus.settings import C
from relax_bus.topology import Topology, build_topology
from relax_bus.worker import Worker
from schemas import DeadLetter, Message, decode, encode

Outcome = Literal["ack", "drop", "retry", "dead_letter", "unsettled"]


class StubKeyValue:
    """A KV bucket in a dict, with JetStream's revisions and compare-and-set errors."""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self._entries: dict[str, KeyValue.Entry] = {}
        self._revisions = itertools.count(1)

    async def get(self, key: str) -> KeyValue.Entry:
        entry = self._entries.get(key)
        if entry is None or entry.operation == "DEL":
            raise nats.js.errors.KeyNotFoundError
        return entry

    async def put(self, key: str, value: bytes) -> int:
        return self._write(key, value, "PUT")

    async def create(self, key: str, value: bytes) -> int:
        return await self.update(key, value, last=0)

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        entry = self._entries.get(key)
        current = 0 if entry is None or (entry.operation == "DEL" and last == 0) else int(entry.revision or 0)
        if last is not None and last != current:
            raise nats.js.errors.KeyWrongLastSequenceError(description=f"wrong last sequence: {current}")
        return self._write(key, value, "PUT")

    async def delete(self, key: str) -> bool:
        self._write(key, b"", "DEL")
        return True

    async def keys(self) -> list[str]:
        return [k for k, e in self._entries.items() if e.operation != "DEL"]

    def _write(self, key: str, value: bytes, operation: str) -> int:
        revision = next(self._revisions)
        self._entries[key] = KeyValue.Entry(self.bucket, key, bytes(value), revision, 0, time.time_ns(), operation)
        return revision


class StubBlobStore:
    """An object store in a dict (the `BlobStore` calls handlers and claim checks make)."""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.objects: dict[str, bytes] = {}

    async def put(self, name: str, data: bytes | memoryview, *args: Any, **kwargs: Any) -> None:
        self.objects[name] = bytes(data)

    async def put_content(self, data: bytes) -> str:
        name = hashlib.sha256(data).hexdigest()
        self.objects[name] = bytes(data)
        return "sha256:" + name

    async def get(self, name: str, timeout_s: float = 30.0, sha256_hex: str | None = None) -> bytes:
        if name not in self.objects:
            raise BlobNotFound(f"no object {name!r} in {self.bucket}")
        return self.objects[name]

    async def get_buffer(self, name: str, *args: Any, **kwargs: Any) -> memoryview:
        return memoryview(await self.get(name))

    async def get_content(self, digest: str) -> bytes:
        return await self.get(digest.removeprefix("sha256:"))

    async def delete(self, name: str) -> None:
        self.objects.pop(name, None)

    async def names(self) -> list[str]:
        return sorted(self.objects)


@dataclass(frozen=True)
class Published:
    """One message stored on a subject of the run."""

    key: str
    """The subject's key in the topology (prompts, rollouts, scored, train, dlq, events)."""
    message: Message
    msg_id: str | None


class StubPublisher:
    """Stores what is published, decoded, by subject key; a repeated message id is a duplicate, as on the server."""

    def __init__(self, topology: Topology) -> None:
        self._keys = {s.subject: s.key for s in topology.streams}
        self._streams = {s.subject: s.name for s in topology.streams}
        self.log: list[Published] = []
        self._seen: set[tuple[str, str]] = set()

    async def publish(
        self, subject: str, message: Message, msg_id: str | None = None, deadline_s: float = 60.0
    ) -> api.PubAck:
        msg_id = msg_id or message_id(message)
        seq = len(self.log) + 1
        if msg_id is not None and (subject, msg_id) in self._seen:
            return api.PubAck(stream=self._streams[subject], seq=seq, duplicate=True)
        if msg_id is not None:
            self._seen.add((subject, msg_id))
        self.log.append(Published(self._keys[subject], message, msg_id))
        return api.PubAck(stream=self._streams[subject], seq=seq)

    async def publish_raw(
        self, subject: str, payload: bytes, headers: dict[str, str], deadline_s: float = 60.0
    ) -> api.PubAck:
        return await self.publish(subject, decode(payload), headers.get(MSG_ID))

    async def publish_many(self, items: list[tuple[str, Message]], deadline_s: float = 60.0) -> list[api.PubAck]:
        return [await self.publish(subject, message) for subject, message in items]


class StubConnection:
    """The connection's part a settle uses: terminations are published to a message's reply subject."""

    is_connected = True
    is_closed = False
    max_payload = 1 << 20

    def __init__(self) -> None:
        self.awaiting: dict[str, StubMsg] = {}
        """Reply subject -> the delivered message it settles."""

    async def publish(self, subject: str, data: bytes = b"", **kwargs: Any) -> None:
        if (msg := self.awaiting.get(subject)) is not None and data.startswith(b"+TERM"):
            msg.actions.append(("term", data.removeprefix(b"+TERM").strip().decode()))

    async def request(self, subject: str, data: bytes = b"", **kwargs: Any) -> None:
        await self.publish(subject, data)

    async def drain(self) -> None:
        self.is_closed = True

    async def close(self) -> None:
        self.is_closed = True


@dataclass
class _Sequence:
    stream: int
    consumer: int


@dataclass
class _Metadata:
    sequence: _Sequence
    num_delivered: int


@dataclass
class StubMsg:
    """A delivered JetStream message that records how it is settled."""

    subject: str
    data: bytes
    reply: str
    metadata: _Metadata
    headers: dict[str, str] | None = None
    actions: list[tuple[str, Any]] = field(default_factory=list)
    _ackd: bool = False

    async def ack(self) -> None:
        self.actions.append(("ack", None))

    async def ack_sync(self, timeout: float = 1.0) -> None:  # noqa: ASYNC109 - nats-py's signature
        self.actions.append(("ack", None))

    async def nak(self, delay: float | None = None) -> None:
        self.actions.append(("nak", delay))

    async def term(self) -> None:
        self.actions.append(("term", ""))

    async def in_progress(self) -> None:
        pass  # keeps a message alive on the server; nothing expires here


@dataclass(frozen=True)
class Handled:
    """How one delivered message was settled, and what its handling published."""

    outcome: Outcome
    reason: str | None
    """Why it was dropped or dead-lettered."""
    delay: float | None
    """The redelivery delay of a retry (None: the server's default)."""
    published: tuple[Published, ...]
    """Everything published while it was handled: outputs, events, its dead letter."""

    def on(self, key: str) -> list[Message]:
        """The messages published on the subject `key`."""
        return [p.message for p in self.published if p.key == key]


class StubBus(Bus[C], Generic[C]):
    """A `Bus` over in-memory stand-ins; `deliver` drives a `Worker` over one message."""

    stub_publisher: StubPublisher
    stub_nc: StubConnection
    stub_sequence: itertools.count[int]

    @classmethod
    def of(cls, config: C) -> StubBus[C]:
        """A stub bus of a run with `config` (the model the roles read, e.g. the pipeline's config)."""
        topology = build_topology(config)
        publisher, nc = StubPublisher(topology), StubConnection()
        state = StubKeyValue(topology.bucket("state"))
        bus = cls(
            nc=cast(Any, nc),
            js=cast(Any, None),  # nothing here talks to JetStream directly
            config=config,
            topology=topology,
            publisher=cast(Any, publisher),
            media=cast(Any, StubBlobStore(topology.object_store("media"))),
            weights=cast(Any, StubBlobStore(topology.object_store("weights"))),
            checkpoints=cast(Any, StubBlobStore(topology.object_store("checkpoints"))),
            state=cast(Any, state),
            workers=cast(Any, StubKeyValue(topology.bucket("workers"))),
            version=PolicyVersion(cast(Any, state)),
        )
        bus.stub_publisher, bus.stub_nc, bus.stub_sequence = publisher, nc, itertools.count(1)
        return bus

    def published(self, key: str) -> list[Message]:
        """Every message published on the subject `key` so far."""
        return [p.message for p in self.stub_publisher.log if p.key == key]

    async def deliver(
        self, worker: Worker[Any], message: Message, deliveries: int = 1, headers: dict[str, str] | None = None
    ) -> Handled:
        """Hand `message` to `worker` as its `deliveries`-th delivery; return how the loop settled it."""
        assert worker.bus is self, "the worker runs on another bus"
        seq = next(self.stub_sequence)
        reply = f"$JS.ACK.{worker.stream.name}.{worker.consumer.durable}.{deliveries}.{seq}.{seq}.0.0"
        msg = StubMsg(
            worker.stream.subject, encode(message), reply, _Metadata(_Sequence(seq, seq), deliveries), headers
        )
        self.stub_nc.awaiting[reply] = msg
        start = len(self.stub_publisher.log)
        try:
            await worker._handle(cast(Any, msg))
        finally:
            del self.stub_nc.awaiting[reply]
        published = tuple(self.stub_publisher.log[start:])
        letters = [p.message for p in published if isinstance(p.message, DeadLetter) and p.message.stream_seq == seq]
        if letters:
            return Handled("dead_letter", letters[-1].reason, None, published)
        kind, value = msg.actions[-1] if msg.actions else ("", None)
        if kind == "term":
            return Handled("drop", value, None, published)
        if kind == "nak":
            return Handled("retry", None, value, published)
        if kind == "ack":
            return Handled("ack", None, None, published)
        return Handled("unsettled", None, None, published)

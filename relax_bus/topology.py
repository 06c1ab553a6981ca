"""The JetStream topology of one run, declared once, as data.

Nothing else in the code base builds a subject, stream, bucket or consumer name by hand: it asks
the `Topology` of its run. `relax_bus.provision` applies it to a server idempotently.

    relax.<run>.prompts   work queue   feeder    -> rollout     (durable consumer "rollout")
    relax.<run>.rollouts  work queue   rollout   -> reward      (durable consumer "reward")
    relax.<run>.scored    work queue   reward    -> reference   (durable consumer "reference")
    relax.<run>.train     limits       reward|reference -> actor (durable consumer "actor"; replayable)
    relax.<run>.dlq       limits       any role: messages the bus gave up on, with the reason
    relax.<run>.events    limits       any role: run events and step metrics
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from relax_bus.settings import RunConfig

HOPS = ("prompts", "rollouts", "scored")
SUBJECT_KEYS = ("prompts", "rollouts", "scored", "train", "dlq", "events")


@dataclass(frozen=True)
class StreamSpec:
    """One JetStream stream."""

    key: str
    name: str
    subject: str
    retention: Literal["workqueue", "limits"]
    max_msgs: int
    max_bytes: int
    max_age_s: float
    discard: Literal["new", "old"]
    duplicate_window_s: float
    storage: Literal["file", "memory"]
    replicas: int


@dataclass(frozen=True)
class ConsumerSpec:
    """One durable pull consumer, shared by every worker of the role that reads it."""

    stream_key: str
    durable: str
    ack_wait_s: float
    max_deliver: int
    max_ack_pending: int


@dataclass(frozen=True)
class BucketSpec:
    """One KV bucket."""

    key: str
    name: str
    ttl_s: float | None
    history: int


@dataclass(frozen=True)
class ObjectStoreSpec:
    """One object store."""

    key: str
    name: str


@dataclass(frozen=True)
class Role:
    """Where a role reads from and writes to."""

    name: str
    input: str | None
    """Subject key it consumes (None: the role has no input stream)."""
    output: str | None
    """Subject key its handler's results go to (None: it publishes nothing downstream)."""


@dataclass(frozen=True)
class Topology:
    """Names and limits of everything one run uses on the server."""

    run: str
    streams: tuple[StreamSpec, ...]
    consumers: tuple[ConsumerSpec, ...]
    buckets: tuple[BucketSpec, ...]
    object_stores: tuple[ObjectStoreSpec, ...]
    roles: tuple[Role, ...]

    def subject(self, key: str) -> str:
        return self.stream(key).subject

    def stream(self, key: str) -> StreamSpec:
        for s in self.streams:
            if s.key == key:
                return s
        raise KeyError(f"no stream {key!r} in the topology of run {self.run}")

    def consumer(self, stream_key: str) -> ConsumerSpec:
        for c in self.consumers:
            if c.stream_key == stream_key:
                return c
        raise KeyError(f"no consumer on stream {stream_key!r} in the topology of run {self.run}")

    def bucket(self, key: str) -> str:
        return next(b.name for b in self.buckets if b.key == key)

    def object_store(self, key: str) -> str:
        return next(o.name for o in self.object_stores if o.key == key)

    def role(self, name: str) -> Role:
        for r in self.roles:
            if r.name == name:
                return r
        known = ", ".join(r.name for r in self.roles)
        raise KeyError(f"unknown role {name!r} (roles: {known})")


def state_bucket(run: str) -> str:
    """Name of the run's state KV bucket (config, policy version, cursors)."""
    return f"relax_{run}_state"


def build_topology(config: RunConfig) -> Topology:
    """Declare the topology of a run from its config."""
    run, bus = config.run, config.bus

    def stream(key: str, retention: Literal["workqueue", "limits"], **limits: float | int | str) -> StreamSpec:
        base: dict[str, float | int | str] = dict(
            max_msgs=-1,
            max_bytes=-1,
            max_age_s=0.0,
            discard="old",
        )
        base.update(limits)
        return StreamSpec(
            key=key,
            name=f"RELAX_{run}_{key.upper()}",
            subject=f"relax.{run}.{key}",
            retention=retention,
            duplicate_window_s=bus.duplicate_window_s,
            storage=bus.storage,
            replicas=bus.replicas,
            **base,  # type: ignore[arg-type]
        )

    hop_limits = dict(max_msgs=bus.hop_max_msgs, max_bytes=bus.hop_max_bytes, discard="new")
    streams = (
        *(stream(k, "workqueue", **hop_limits) for k in HOPS),  # type: ignore[arg-type]
        stream("train", "limits", max_age_s=bus.train_max_age_s, max_bytes=bus.train_max_bytes),
        stream("dlq", "limits", max_age_s=bus.dlq_max_age_s),
        stream("events", "limits", max_msgs=bus.events_max_msgs),
    )
    reward_out = "scored" if config.reference else "train"
    roles = (
        Role("feeder", None, "prompts"),
        Role("rollout", "prompts", "rollouts"),
        Role("reward", "rollouts", reward_out),
        *((Role("reference", "scored", "train"),) if config.reference else ()),
        Role("actor", "train", None),
    )
    consumers = tuple(
        ConsumerSpec(
            stream_key=r.input,
            durable=r.name,
            ack_wait_s=bus.ack_wait_s,
            max_deliver=bus.max_deliver,
            max_ack_pending=bus.max_ack_pending,
        )
        for r in roles
        if r.input is not None
    )
    buckets = (
        BucketSpec("state", state_bucket(run), ttl_s=None, history=16),
        BucketSpec("workers", f"relax_{run}_workers", ttl_s=bus.heartbeat_ttl_s, history=1),
    )
    stores = (
        ObjectStoreSpec("weights", f"relax_{run}_weights"),
        ObjectStoreSpec("media", f"relax_{run}_media"),
    )
    return Topology(run, streams, consumers, buckets, stores, roles)

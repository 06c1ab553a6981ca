"""The JetStream topology of one run, declared once, as data.

Nothing else in the code base builds a subject, stream, bucket or consumer name by hand: it asks
the `Topology` of its run. `relax_bus.provision` applies it to a server idempotently.

    relax.<run>.<hop>     work queue   hand-off between stages, one per key the run's roles pass along (the
                                       run's `chain`, `relax_bus.chain.hop_keys`: prompts, rollouts, scored
                                       in the pipeline); one durable consumer per stream, named after the
                                       role that reads it
    relax.<run>.train     limits       the trainer's input, kept for replay
    relax.<run>.dlq       limits       any role: messages the bus gave up on, with the reason
    relax.<run>.events    limits       any role: run events and step metrics

    relax_<run>_weights   object store  the trainer: policy versions, read by the roles that load weights
    relax_<run>_checkpoints object store  the trainer only: whole checkpoints (optimizer state, ledger)
    relax_<run>_media     object store  any role: claim-check payloads (deleted when their hop message is
                                        settled, aged out otherwise) and media items
    relax_<run>_state     KV            run config, policy version, cursors, credits
    relax_<run>_workers   KV            heartbeats, one key `<role>.<worker id>` per worker, with a TTL

Environments of agentic runs are core-NATS services (`nats.micro`), not streams: nothing is stored.

    relax.<run>.env.reset              queue group `env`: every environment server of the run; starts an episode
    relax.<run>.env.<instance>.step    one server's own: the next action of an episode it holds
    relax.<run>.env.<instance>.close   one server's own: the end of an episode it holds
    $SRV.PING|INFO|STATS[.relax-env]   the service's discovery subjects (`nats micro ls`, `relax inspect`)

Every limit is bounded: messages by `bus.max_msg_bytes` on every stream (heartbeats by
`bus.heartbeat_max_bytes`), each stream, bucket and store by bytes (the setting that bounds it is named on its
spec, for errors that say what to raise or lower), and consumers by `bus.max_consumers` on each. The
exceptions are the weights and checkpoints stores when `bus.weights_max_bytes` / `bus.checkpoints_max_bytes` are
null: a byte bound is reserved up front, so they are bounded instead by the trainer's retention and, as a whole,
by the run account's finite file limit (`relax_bus.ops.server_conf`).

A hop's messages leave only when its consumer settles them (no `max_age`): a message under another subject (one
delivered into the hop by a push consumer rather than published) is never delivered, so `sweep_hops` (the admin's,
`relax_bus.provision`) purges those subjects rather than an age limit that would also expire real work unseen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from relax_bus.chain import Role
from relax_bus.settings import RunConfig

__all__ = ["EnvSubjects", "Role", "Topology", "build_topology", "env_subjects", "state_bucket"]

ENV_SERVICE = "relax-env"
"""The `nats.micro` service name of every environment server (`$SRV.*.relax-env`); its metadata names the run."""
ENV_QUEUE = "env"
"""The queue group of the environment servers' endpoints."""
DISCOVERY_VERBS = ("PING", "INFO", "STATS")


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
    max_msg_size: int
    """Largest message the stream stores (headers included); a bigger publish is refused."""
    max_consumers: int
    """Consumers the stream accepts (its durable ones included); a further create is refused."""
    bytes_setting: str
    """The dotted setting that sets `max_bytes`."""


@dataclass(frozen=True)
class ConsumerSpec:
    """One durable pull consumer, shared by every worker of the role that reads it."""

    stream_key: str
    durable: str
    filter_subject: str
    """The hop's subject. A message another consumer delivered into the stream keeps its own subject (the
    server does not check delivery subjects against permissions); the filter leaves it undelivered."""
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
    max_bytes: int
    max_value_size: int
    """Largest value (a put above it is refused)."""
    bytes_setting: str
    """The dotted setting that sets `max_bytes`."""


@dataclass(frozen=True)
class ObjectStoreSpec:
    """One object store (a stream of chunks with discard=new: a full store refuses the next object)."""

    key: str
    name: str
    max_bytes: int
    max_age_s: float
    """0: objects stay until deleted."""
    bytes_setting: str
    """The dotted setting that sets `max_bytes`."""


@dataclass(frozen=True)
class EnvSubjects:
    """The subjects of a run's environment service (an environment class served with `nats.micro`): one reset
    subject shared by every server in a queue group, and each server instance's own step and close subjects."""

    run: str
    service: str = ENV_SERVICE
    queue: str = ENV_QUEUE

    @property
    def prefix(self) -> str:
        return f"relax.{self.run}.env"

    @property
    def reset(self) -> str:
        """Where an episode starts: any server of the run answers (queue group `queue`)."""
        return f"{self.prefix}.reset"

    def step(self, instance: str) -> str:
        """Where the episodes held by server `instance` take their next action."""
        return f"{self.prefix}.{instance}.step"

    def close(self, instance: str) -> str:
        """Where server `instance` is told an episode it holds is over."""
        return f"{self.prefix}.{instance}.close"

    def endpoints(self) -> tuple[str, ...]:
        """Every endpoint subject of every instance (a wildcard for the instance)."""
        return (self.reset, self.step("*"), self.close("*"))

    def discovery(self) -> tuple[str, ...]:
        """The `$SRV` subjects a server of the service answers: each verb for all services, this one, an instance."""
        return tuple(
            subject
            for verb in DISCOVERY_VERBS
            for subject in (f"$SRV.{verb}", f"$SRV.{verb}.{self.service}", f"$SRV.{verb}.{self.service}.*")
        )

    @property
    def stats(self) -> str:
        """Where every server of the service reports its endpoints' figures (`relax inspect`)."""
        return f"$SRV.STATS.{self.service}"


def env_subjects(run: str) -> EnvSubjects:
    """The environment service subjects of `run` (they need nothing of its config but the name)."""
    return EnvSubjects(run)


@dataclass(frozen=True)
class Topology:
    """Names and limits of everything one run uses on the server."""

    run: str
    streams: tuple[StreamSpec, ...]
    consumers: tuple[ConsumerSpec, ...]
    buckets: tuple[BucketSpec, ...]
    object_stores: tuple[ObjectStoreSpec, ...]
    roles: tuple[Role, ...]

    @property
    def subject_keys(self) -> tuple[str, ...]:
        """Every stream of the run, by key: the hops, then the limits streams."""
        return tuple(s.key for s in self.streams)

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

    @property
    def env(self) -> EnvSubjects:
        """The run's environment service subjects."""
        return env_subjects(self.run)

    def reserved_bytes(self) -> dict[str, int]:
        """What the run's byte bounds reserve on a server holding it, by the setting that sets them."""
        bounds = [*((s.bytes_setting, s.max_bytes) for s in self.streams)]
        bounds += [(b.bytes_setting, b.max_bytes) for b in self.buckets]
        bounds += [(o.bytes_setting, o.max_bytes) for o in self.object_stores]
        out: dict[str, int] = {}
        for setting, size in bounds:
            out[setting] = out.get(setting, 0) + max(size, 0)  # -1: unbounded, nothing reserved
        return out

    def role(self, name: str) -> Role:
        for r in self.roles:
            if r.name == name:
                return r
        known = ", ".join(r.name for r in self.roles)
        raise KeyError(f"unknown role {name!r} (roles: {known})")


def _bound(max_bytes: int | None) -> int:
    """A byte bound as JetStream takes it: -1 for none."""
    return -1 if max_bytes is None else max_bytes


def state_bucket(run: str) -> str:
    """Name of the run's state KV bucket (config, policy version, cursors)."""
    return f"relax_{run}_state"


def build_topology(config: RunConfig) -> Topology:
    """Declare the topology of a run from its config."""
    run, bus = config.run, config.bus

    def stream(key: str, retention: Literal["workqueue", "limits"], **limits: float | int | str) -> StreamSpec:
        base: dict[str, float | int | str] = dict(
            max_msgs=-1,
            max_age_s=0.0,
            discard="old",
            bytes_setting=f"bus.{key}_max_bytes",
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
            max_msg_size=bus.msg_bytes_limit,
            max_consumers=bus.max_consumers,
            **base,  # type: ignore[arg-type]
        )

    hop_limits = dict(
        max_msgs=bus.hop_max_msgs, max_bytes=bus.hop_max_bytes, discard="new", bytes_setting="bus.hop_max_bytes"
    )
    streams = (
        *(stream(k, "workqueue", **hop_limits) for k in config.hop_keys()),  # type: ignore[arg-type]
        stream("train", "limits", max_age_s=bus.train_max_age_s, max_bytes=bus.train_max_bytes),
        stream("dlq", "limits", max_age_s=bus.dlq_max_age_s, max_bytes=bus.dlq_max_bytes),
        stream("events", "limits", max_msgs=bus.events_max_msgs, max_bytes=bus.events_max_bytes),
    )
    roles = config.chain
    consumers = tuple(
        ConsumerSpec(
            stream_key=r.input,
            durable=r.name,
            filter_subject=next(s.subject for s in streams if s.key == r.input),
            ack_wait_s=bus.ack_wait_s,
            max_deliver=bus.max_deliver,
            max_ack_pending=bus.max_ack_pending,
        )
        for r in roles
        if r.input is not None
    )
    buckets = (
        BucketSpec(
            "state",
            state_bucket(run),
            None,
            16,
            bus.state_max_bytes,
            min(bus.msg_bytes_limit, bus.state_max_bytes),  # the largest value: the run config, a few KiB
            "bus.state_max_bytes",
        ),
        BucketSpec(
            "workers",
            f"relax_{run}_workers",
            bus.heartbeat_ttl_s,
            1,
            bus.workers_max_bytes,
            bus.heartbeat_max_bytes,
            "bus.workers_max_bytes",
        ),
        BucketSpec(
            "episodes",
            f"relax_{run}_episodes",
            bus.episodes_max_age_s,
            1,
            bus.episodes_max_bytes,
            min(bus.msg_bytes_limit, bus.episodes_max_bytes),
            "bus.episodes_max_bytes",
        ),
    )
    stores = (
        ObjectStoreSpec("weights", f"relax_{run}_weights", _bound(bus.weights_max_bytes), 0.0, "bus.weights_max_bytes"),
        ObjectStoreSpec(
            "checkpoints",
            f"relax_{run}_checkpoints",
            _bound(bus.checkpoints_max_bytes),
            0.0,
            "bus.checkpoints_max_bytes",
        ),
        ObjectStoreSpec("media", f"relax_{run}_media", bus.media_max_bytes, bus.media_max_age_s, "bus.media_max_bytes"),
    )
    return Topology(run, streams, consumers, buckets, stores, roles)

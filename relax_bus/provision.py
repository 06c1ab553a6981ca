"""Applying a run's topology to a server, idempotently, and keeping the run config in KV.

`provision` creates what is missing, updates limits that may change (a stream's bounds, largest message and
consumer count, a bucket's bytes and largest value, an object store's bytes and age: a run made before a bound
existed gets it), and refuses (TopologyConflict) anything that cannot change under a live run: a stream's
retention or storage, or a run setting outside `settings.TUNABLE`.

JetStream reserves every byte bound on the server's disk (or memory) when the stream is created, so a
run that asks for more than the server has left is refused at once, with the settings to lower.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue
from nats.js.object_store import OBJ_STREAM_TEMPLATE
from pydantic import ValidationError

from relax_bus.backoff import retrying
from relax_bus.errors import ConfigError, ProvisionFailed, RunNotFound, TopologyConflict
from relax_bus.log import get_logger
from relax_bus.settings import C, RunConfig, incompatible_changes, validation_problems
from relax_bus.topology import (
    BucketSpec,
    ConsumerSpec,
    ObjectStoreSpec,
    StreamSpec,
    Topology,
    build_topology,
    state_bucket,
)

log = get_logger(__name__)

CONFIG_KEY = "config"
INSUFFICIENT_STORAGE = 10047


@dataclass
class ProvisionReport:
    """What `provision` did, by object name."""

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)


def _stream_config(s: StreamSpec) -> api.StreamConfig:
    return api.StreamConfig(
        name=s.name,
        subjects=[s.subject],
        retention=api.RetentionPolicy.WORK_QUEUE if s.retention == "workqueue" else api.RetentionPolicy.LIMITS,
        max_msgs=s.max_msgs,
        max_bytes=s.max_bytes,
        max_age=s.max_age_s,
        max_msg_size=s.max_msg_size,
        max_consumers=s.max_consumers,
        discard=api.DiscardPolicy.NEW if s.discard == "new" else api.DiscardPolicy.OLD,
        duplicate_window=s.duplicate_window_s,
        storage=api.StorageType.FILE if s.storage == "file" else api.StorageType.MEMORY,
        num_replicas=s.replicas,
        allow_direct=True,  # roles read by direct get, never through a consumer of their own
    )


def _consumer_config(c: ConsumerSpec) -> api.ConsumerConfig:
    return api.ConsumerConfig(
        durable_name=c.durable,
        filter_subject=c.filter_subject,
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=c.ack_wait_s,
        max_deliver=c.max_deliver,
        max_ack_pending=c.max_ack_pending,
        max_waiting=512,
    )


def _close(a: float | int | None, b: float | int | None) -> bool:
    return abs((a or 0) - (b or 0)) < 1e-3


def _refused(err: nats.js.errors.APIError, t: Topology, what: str, max_bytes: int, setting: str) -> ProvisionFailed:
    """The error for a stream or store the server would not create or resize."""
    if err.err_code != INSUFFICIENT_STORAGE:
        return ProvisionFailed(f"cannot create or update {what}: {err.description or err}")
    reserved = t.reserved_bytes()
    total = sum(reserved.values())
    largest = ", ".join(f"{k} {v / (1 << 30):.2g} GiB" for k, v in sorted(reserved.items(), key=lambda kv: -kv[1]))
    storage = "max_memory_store" if t.streams[0].storage == "memory" else "max_file_store"
    return ProvisionFailed(
        f"the server cannot reserve {max_bytes / (1 << 20):.0f} MiB for {what} ({setting}); the run reserves "
        f"{total / (1 << 30):.1f} GiB in all ({largest}): lower those settings, or give JetStream more "
        f"storage ({storage})"
    )


async def _apply_stream(js: JetStreamContext, t: Topology, s: StreamSpec, report: ProvisionReport) -> None:
    want = _stream_config(s)
    try:
        have = (await js.stream_info(s.name)).config
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(want)
        except nats.js.errors.APIError as err:
            raise _refused(err, t, f"stream {s.name}", s.max_bytes, s.bytes_setting) from None
        report.created.append(s.name)
        return
    fixed = [
        ("retention", have.retention, want.retention),
        ("storage", have.storage, want.storage),
        ("subjects", have.subjects, want.subjects),
    ]
    for what, old, new in fixed:
        if old != new:
            raise TopologyConflict(f"stream {s.name} exists with {what} {old}, the config asks for {new}")
    limits = ("max_msgs", "max_bytes", "max_age", "max_msg_size", "max_consumers", "discard", "duplicate_window",
              "num_replicas")  # fmt: skip
    if have.allow_direct and all(
        _close(getattr(have, k), getattr(want, k)) if k != "discard" else have.discard == want.discard for k in limits
    ):
        report.unchanged.append(s.name)
        return
    try:
        await js.update_stream(want)
    except nats.js.errors.APIError as err:
        raise _refused(err, t, f"stream {s.name}", s.max_bytes, s.bytes_setting) from None
    report.updated.append(s.name)


async def _apply_store(
    js: JetStreamContext, t: Topology, o: ObjectStoreSpec, config: RunConfig, report: ProvisionReport
) -> None:
    """Create an object store with its limits, or bring an existing one's byte bound, age and consumer count to
    the config's (nats-py creates a store without a consumer bound: it is set right after).

    Lowering a store's byte bound below what it holds keeps its objects (discard=new only refuses new ones)."""
    stream = OBJ_STREAM_TEMPLATE.format(bucket=o.name)
    what = f"object store {o.name}"
    try:
        have = (await js.stream_info(stream)).config
    except nats.js.errors.NotFoundError:
        store = api.ObjectStoreConfig(
            max_bytes=o.max_bytes,
            ttl=o.max_age_s or None,
            storage=api.StorageType.FILE if config.bus.storage == "file" else api.StorageType.MEMORY,
            replicas=config.bus.replicas,
        )
        try:
            await js.create_object_store(o.name, config=store)
            have = (await js.stream_info(stream)).config
        except nats.js.errors.APIError as err:
            raise _refused(err, t, what, o.max_bytes, o.bytes_setting) from None
        report.created.append(o.name)
    consumers = config.bus.max_consumers
    same = _close(have.max_bytes, o.max_bytes) and _close(have.max_age, o.max_age_s)
    if same and have.max_consumers == consumers and have.allow_direct:
        if o.name not in report.created:
            report.unchanged.append(o.name)
        return
    have.max_bytes, have.max_age, have.max_consumers, have.allow_direct = o.max_bytes, o.max_age_s, consumers, True
    try:
        await js.update_stream(have)
    except nats.js.errors.APIError as err:
        raise _refused(err, t, what, o.max_bytes, o.bytes_setting) from None
    if o.name not in report.created:
        report.updated.append(o.name)


async def _apply_bucket(
    js: JetStreamContext, t: Topology, b: BucketSpec, config: RunConfig, report: ProvisionReport
) -> None:
    """Create a KV bucket with its bounds, or bring an existing one's bytes, largest value and consumers to the
    config's (a bucket created before it had bounds gets them here)."""
    stream = f"KV_{b.name}"
    try:
        have = (await js.stream_info(stream)).config
    except nats.js.errors.NotFoundError:
        try:
            await js.create_key_value(
                bucket=b.name,
                history=b.history,
                ttl=b.ttl_s,
                max_bytes=b.max_bytes,
                max_value_size=b.max_value_size,
                storage=api.StorageType.FILE if config.bus.storage == "file" else api.StorageType.MEMORY,
                replicas=config.bus.replicas,
                direct=True,
                # With a TTL, expiry leaves a marker so watchers see a vanished worker as a purge.
                limit_marker_ttl=b.ttl_s,
            )
            have = (await js.stream_info(stream)).config
        except nats.js.errors.APIError as err:
            raise _refused(err, t, f"KV bucket {b.name}", b.max_bytes, b.bytes_setting) from None
        report.created.append(b.name)
    consumers = config.bus.max_consumers
    want = (b.max_bytes, b.max_value_size, consumers)
    if (have.max_bytes, have.max_msg_size, have.max_consumers) == want and have.allow_direct:
        if b.name not in report.created:
            report.unchanged.append(b.name)
        return
    have.max_bytes, have.max_msg_size, have.max_consumers, have.allow_direct = (*want, True)
    try:
        await js.update_stream(have)
    except nats.js.errors.APIError as err:
        raise _refused(err, t, f"KV bucket {b.name}", b.max_bytes, b.bytes_setting) from None
    if b.name not in report.created:
        report.updated.append(b.name)


async def _apply_consumer(js: JetStreamContext, t: Topology, c: ConsumerSpec, report: ProvisionReport) -> None:
    stream = t.stream(c.stream_key).name
    want = _consumer_config(c)
    label = f"{stream}/{c.durable}"
    try:
        have = (await js.consumer_info(stream, c.durable)).config
    except nats.js.errors.NotFoundError:
        await js.add_consumer(stream, want)
        report.created.append(label)
        return
    same = (
        _close(have.ack_wait, want.ack_wait)
        and have.max_deliver == want.max_deliver
        and have.max_ack_pending == want.max_ack_pending
        and have.filter_subject == want.filter_subject
    )
    if same:
        report.unchanged.append(label)
        return
    await js.add_consumer(stream, want)  # same durable name: the server updates it in place
    report.updated.append(label)


async def provision(js: JetStreamContext, config: RunConfig) -> ProvisionReport:
    """Create or update everything the run needs and store its config; refuse incompatible changes."""
    topology = build_topology(config)
    report = ProvisionReport()
    old = await read_config(js, config.run, missing_ok=True, model=type(config))
    if old is not None:
        changes = incompatible_changes(old, config)
        if changes:
            lines = "; ".join(changes)
            raise TopologyConflict(
                f"run {config.run!r} already exists with different settings that cannot change: {lines}. "
                "Use a new run id, or keep the old values."
            )
    for s in topology.streams:
        await _apply_stream(js, topology, s, report)
    for c in topology.consumers:
        await _apply_consumer(js, topology, c, report)
    await sweep_hops(js, topology)
    for b in topology.buckets:
        await _apply_bucket(js, topology, b, config, report)
    for o in topology.object_stores:
        await _apply_store(js, topology, o, config, report)
    state = await js.key_value(topology.bucket("state"))
    await state.put(CONFIG_KEY, config.model_dump_json().encode())
    return report


async def sweep_hops(js: JetStreamContext, topology: Topology) -> dict[str, int]:
    """Purge from every hop the messages under any subject but the hop's own; the count purged, by subject.

    A hop's stream listens on its subject only, yet a push consumer that delivers to that subject puts messages
    into it under their original subjects (nats-server does not check delivery subjects against permissions).
    Its filtered durable never sees them, and a work queue keeps a message until it is acked, so they would hold
    the hop full (discard=new) for good. An age limit would remove them too, but also real work that waited
    that long, with no dead letter and no credit: the run would wait forever for groups that are gone. Purging
    by subject removes only what no consumer of the run can ever read. Admin only (purge); `provision` sweeps,
    and so may whoever holds the admin's credentials during a run."""
    purged: dict[str, int] = {}
    for key in topology.subject_keys:
        spec = topology.stream(key)
        if spec.retention != "workqueue":
            continue
        try:
            info = await js.stream_info(spec.name, subjects_filter=">")
        except nats.js.errors.NotFoundError:
            continue
        for subject, count in (info.state.subjects or {}).items():
            if subject != spec.subject:
                await js.purge_stream(spec.name, subject=subject)
                purged[subject] = count
    if purged:
        log.warning("hop_foreign_messages_purged", purged=sum(purged.values()), subjects=len(purged))
    return purged


async def delete_run(js: JetStreamContext, config: RunConfig) -> list[str]:
    """Delete every stream, bucket and object store of the run (its data included); the names deleted.

    What is already gone is skipped, so a half-provisioned run is removed too. The run config goes last
    (with the state bucket), so an interrupted delete can be repeated from the stored config."""
    topology = build_topology(config)
    deleted: list[str] = []
    deletions = [
        *((s.name, js.delete_stream, s.name) for s in topology.streams),
        *((f"OBJ_{o.name}", js.delete_object_store, o.name) for o in topology.object_stores),
        *((f"KV_{b.name}", js.delete_key_value, b.name) for b in reversed(topology.buckets)),
    ]
    for label, delete, name in deletions:
        try:
            await delete(name)
        except nats.js.errors.NotFoundError:
            continue
        deleted.append(label)
    return deleted


async def state_kv(js: JetStreamContext, run: str) -> KeyValue:
    """The run's state bucket; RunNotFound when the run was never initialised."""
    try:
        return await js.key_value(state_bucket(run))
    except nats.js.errors.BucketNotFoundError:
        raise RunNotFound(f"run {run!r} is not initialised on this server (run `relax init CONFIG` first)") from None


async def read_config(
    js: JetStreamContext,
    run: str,
    missing_ok: bool = False,
    model: type[C] = RunConfig,  # type: ignore[assignment]
) -> C | None:
    """The run config stored by `relax init`, read as `model` (sections `model` does not know are ignored)."""
    try:
        kv = await state_kv(js, run)
        entry = await kv.get(CONFIG_KEY)
    except (RunNotFound, nats.js.errors.KeyNotFoundError):
        if missing_ok:
            return None
        raise RunNotFound(f"run {run!r} is not initialised on this server (run `relax init CONFIG` first)") from None
    source = f"KV {state_bucket(run)}/{CONFIG_KEY}"
    try:
        return model.from_stored(json.loads(entry.value or b"{}"))
    except ValidationError as err:
        raise ConfigError(source, validation_problems(err)) from None


# What a server that is still starting answers: no JetStream responder yet, a cluster without a
# meta leader (503), or too few peers joined to place a replicated stream (ProvisionFailed).
_NOT_READY = (
    nats.errors.NoRespondersError,
    nats.errors.TimeoutError,
    nats.js.errors.ServiceUnavailableError,
    ProvisionFailed,
)


async def provision_when_ready(js: JetStreamContext, config: RunConfig, wait_s: float) -> ProvisionReport:
    """`provision`, retried for up to `wait_s` seconds while JetStream is not ready (a fresh server or cluster).

    Waits between attempts: 0.25 s doubling up to 2 s, plus up to 0.25 s of jitter (`relax_bus.backoff`)."""
    deadline = time.monotonic() + wait_s
    try:
        # Tolerated until the deadline: a cluster elects its JetStream leader seconds after it starts.
        async for attempt in retrying(_NOT_READY, wait_s, wait_initial=0.25, wait_max=2.0):
            with attempt:
                try:
                    return await provision(js, config)
                except _NOT_READY as err:
                    if time.monotonic() < deadline:
                        log.info("jetstream_not_ready", attempt=attempt.num, error=f"{type(err).__name__}: {err}")
                    raise
    except _NOT_READY as err:
        if isinstance(err, ProvisionFailed) or wait_s <= 0:
            raise
        raise ProvisionFailed(f"JetStream was not ready within {wait_s:g}s ({type(err).__name__}: {err})") from None
    raise AssertionError("unreachable: stamina re-raises the last error")

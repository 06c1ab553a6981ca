"""Applying a run's topology to a server, idempotently, and keeping the run config in KV.

`provision` creates what is missing, updates limits that may change, and refuses (TopologyConflict)
anything that cannot change under a live run: a stream's retention or storage, or a run setting
outside `settings.TUNABLE`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from relax_bus.errors import ProvisionFailed, RunNotFound, TopologyConflict
from relax_bus.log import get_logger
from relax_bus.settings import RunConfig, incompatible_changes, parse_run_config
from relax_bus.topology import ConsumerSpec, StreamSpec, Topology, build_topology, state_bucket

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
        discard=api.DiscardPolicy.NEW if s.discard == "new" else api.DiscardPolicy.OLD,
        duplicate_window=s.duplicate_window_s,
        storage=api.StorageType.FILE if s.storage == "file" else api.StorageType.MEMORY,
        num_replicas=s.replicas,
    )


def _consumer_config(c: ConsumerSpec) -> api.ConsumerConfig:
    return api.ConsumerConfig(
        durable_name=c.durable,
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=c.ack_wait_s,
        max_deliver=c.max_deliver,
        max_ack_pending=c.max_ack_pending,
        max_waiting=512,
    )


def _close(a: float | int | None, b: float | int | None) -> bool:
    return abs((a or 0) - (b or 0)) < 1e-3


async def _apply_stream(js: JetStreamContext, s: StreamSpec, report: ProvisionReport) -> None:
    want = _stream_config(s)
    try:
        have = (await js.stream_info(s.name)).config
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(want)
        except nats.js.errors.APIError as err:
            if err.err_code == INSUFFICIENT_STORAGE:
                raise ProvisionFailed(
                    f"the server cannot reserve {s.max_bytes / (1 << 20):.0f} MiB for stream {s.name}: lower "
                    "bus.hop_max_bytes / bus.train_max_bytes, or give JetStream more storage (max_file_store)"
                ) from None
            raise ProvisionFailed(f"cannot create stream {s.name}: {err.description or err}") from None
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
    limits = ("max_msgs", "max_bytes", "max_age", "discard", "duplicate_window", "num_replicas")
    if all(
        _close(getattr(have, k), getattr(want, k)) if k != "discard" else have.discard == want.discard for k in limits
    ):
        report.unchanged.append(s.name)
        return
    await js.update_stream(want)
    report.updated.append(s.name)


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
    old = await read_config(js, config.run, missing_ok=True)
    if old is not None:
        changes = incompatible_changes(old, config)
        if changes:
            lines = "; ".join(changes)
            raise TopologyConflict(
                f"run {config.run!r} already exists with different settings that cannot change: {lines}. "
                "Use a new run id, or keep the old values."
            )
    for s in topology.streams:
        await _apply_stream(js, s, report)
    for c in topology.consumers:
        await _apply_consumer(js, topology, c, report)
    storage = api.StorageType.FILE if config.bus.storage == "file" else api.StorageType.MEMORY
    for b in topology.buckets:
        try:
            await js.key_value(b.name)
            report.unchanged.append(b.name)
        except nats.js.errors.BucketNotFoundError:
            await js.create_key_value(
                bucket=b.name,
                history=b.history,
                ttl=b.ttl_s,
                storage=storage,
                replicas=config.bus.replicas,
                # With a TTL, expiry leaves a marker so watchers see a vanished worker as a purge.
                limit_marker_ttl=b.ttl_s,
            )
            report.created.append(b.name)
    for o in topology.object_stores:
        try:
            await js.object_store(o.name)
            report.unchanged.append(o.name)
        except nats.js.errors.NotFoundError:
            await js.create_object_store(bucket=o.name, storage=storage, replicas=config.bus.replicas)
            report.created.append(o.name)
    state = await js.key_value(topology.bucket("state"))
    await state.put(CONFIG_KEY, config.model_dump_json().encode())
    return report


async def state_kv(js: JetStreamContext, run: str) -> KeyValue:
    """The run's state bucket; RunNotFound when the run was never initialised."""
    try:
        return await js.key_value(state_bucket(run))
    except nats.js.errors.BucketNotFoundError:
        raise RunNotFound(f"run {run!r} is not initialised on this server (run `relax init CONFIG` first)") from None


async def read_config(js: JetStreamContext, run: str, missing_ok: bool = False) -> RunConfig | None:
    """The run config stored by `relax init`."""
    try:
        kv = await state_kv(js, run)
        entry = await kv.get(CONFIG_KEY)
    except (RunNotFound, nats.js.errors.KeyNotFoundError):
        if missing_ok:
            return None
        raise RunNotFound(f"run {run!r} is not initialised on this server (run `relax init CONFIG` first)") from None
    return parse_run_config(json.loads(entry.value or b"{}"), source=f"KV {state_bucket(run)}/{CONFIG_KEY}")


# What a server that is still starting answers: no JetStream responder yet, a cluster without a
# meta leader (503), or too few peers joined to place a replicated stream (ProvisionFailed).
_NOT_READY = (
    nats.errors.NoRespondersError,
    nats.errors.TimeoutError,
    nats.js.errors.ServiceUnavailableError,
    ProvisionFailed,
)


async def provision_when_ready(js: JetStreamContext, config: RunConfig, wait_s: float) -> ProvisionReport:
    """`provision`, retried for up to `wait_s` seconds while JetStream is not ready (a fresh server or cluster)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await provision(js, config)
        except _NOT_READY as err:
            # Tolerated until the deadline: a cluster elects its JetStream leader seconds after it starts.
            if time.monotonic() + 1.0 > deadline:
                if isinstance(err, ProvisionFailed) or wait_s <= 0:
                    raise
                raise ProvisionFailed(
                    f"JetStream was not ready within {wait_s:g}s ({type(err).__name__}: {err})"
                ) from None
            log.info("jetstream_not_ready", error=f"{type(err).__name__}: {err}")
            await asyncio.sleep(1.0)

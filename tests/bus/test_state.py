"""Policy version (CAS + watcher), heartbeats, KV counters and the staleness rule against a real server."""

import asyncio
import time

import pytest

from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.errors import VersionConflict
from relax_bus.heartbeat import HeartbeatWriter, live_workers
from relax_bus.kv_counter import KvCounter
from relax_bus.kv_keys import kv_keys
from relax_bus.worker import Delivery, Worker, WorkerOptions
from schemas import PromptGroup, RunEvent, TrainGroup, WorkerHeartbeat
from tests import factories as f
from tests.bus.test_publish import read_all
from tests.waiting import until
from workers.config import PipelineConfig
from workers.roles.stale_groups import admit_fresh
from workers.state_keys import GROUPS_DROPPED

pytestmark = pytest.mark.bus


async def test_version_cas_refuses_a_stale_write(bus):
    assert await bus.version.get() == (0, 0)
    rev1 = await bus.version.advance(1, expected_revision=0)
    assert await bus.version.get() == (1, rev1)
    rev2 = await bus.version.advance(2, expected_revision=rev1)
    with pytest.raises(VersionConflict, match="changed by another writer"):
        await bus.version.advance(3, expected_revision=rev1)  # a zombie trainer's write
    with pytest.raises(VersionConflict, match="may only grow"):
        await bus.version.advance(2, expected_revision=rev2)
    with pytest.raises(VersionConflict):
        await bus.version.advance(1, expected_revision=0)  # creating again is a conflict too
    assert await bus.version.get() == (2, rev2)


async def test_version_watcher_sees_updates_and_survives_a_server_restart(bus, nats_server, settings):
    seen: list[int] = []

    async def watch():
        async for v in bus.version.watch(poll_s=0.5):
            seen.append(v)

    task = asyncio.create_task(watch())
    try:
        rev = await bus.version.advance(1, 0)
        await until(lambda: list(seen), lambda s: s in ([0, 1], [1]), timeout_s=30, what="versions 0, 1 seen")
        nats_server.stop()
        nats_server.start()  # same port, same store dir: streams and KV survive
        writer = await Bus.connect(settings, bus.run, config_model=PipelineConfig)
        try:
            await writer.version.advance(2, rev)
        finally:
            await writer.close()
        await until(lambda: list(seen), lambda s: s[-1:] == [2], timeout_s=15, what="version 2 seen")
        assert seen == sorted(set(seen))
    finally:
        task.cancel()


async def test_heartbeat_is_listed_then_disappears_after_its_ttl(bus):
    def beat():
        return WorkerHeartbeat(run=bus.run, role="reward", worker_id="w1", pid=1, host="h", started_at=time.time())

    writer = HeartbeatWriter(bus.workers, "reward.w1", beat, interval_s=0.3)
    writer.start()

    async def listed() -> list[str]:
        return [w.worker_id for w in await live_workers(bus.workers)]

    await until(listed, lambda ids: ids == ["w1"], timeout_s=30, what="worker w1 listed")
    await writer.stop(remove=False)  # as if the worker hung or was killed: no more beats, no delete
    last = writer.last_beat_at
    assert last is not None
    ttl = bus.config.bus.heartbeat_ttl_s
    while await live_workers(bus.workers):
        assert time.monotonic() - last < ttl * 3, "heartbeat outlived its TTL"
        await asyncio.sleep(0.05)
    # Gone no earlier than its TTL after the last beat was stored (load can only make this later).
    assert time.monotonic() - last >= ttl * 0.9, f"gone {time.monotonic() - last:.2f}s after the last beat"


async def test_kv_keys_lists_each_key_once_and_an_empty_bucket_as_empty(bus):
    assert await kv_keys(bus.workers) == []
    await bus.workers.put("reward.w2", b"a")
    await bus.workers.put("reward.w1", b"b")
    await bus.workers.put("reward.w1", b"c")
    assert await kv_keys(bus.workers) == ["reward.w1", "reward.w2"]
    await bus.workers.delete("reward.w2")  # its delete marker keeps the key listed; readers skip it
    assert await kv_keys(bus.workers) == ["reward.w1", "reward.w2"]
    assert [w for w in await live_workers(bus.workers)] == []  # neither value is a heartbeat


async def test_a_running_worker_heartbeats_and_removes_itself_on_stop(bus):
    async def idle(prompt, delivery):
        return None

    worker = Worker(bus, "rollout", idle, PromptGroup, WorkerOptions(fetch_timeout_s=0.2))
    task = asyncio.create_task(worker.run())
    (beat,) = await until(lambda: live_workers(bus.workers), bool, timeout_s=30, what="a live worker")
    assert beat.role == "rollout" and beat.worker_id == worker.worker_id and "processed" in beat.counters
    worker.stop()
    await task
    assert await live_workers(bus.workers) == []


async def test_counter_compare_and_set_with_concurrent_writers(bus, settings):
    others = [await connect(settings) for _ in range(3)]
    try:
        kvs = [await nc.jetstream().key_value(bus.topology.bucket("state")) for nc in others]
        await asyncio.gather(*(KvCounter(kv, GROUPS_DROPPED).add(1) for kv in kvs for _ in range(5)))
        assert (await KvCounter(bus.state, GROUPS_DROPPED).get())[0] == 15
    finally:
        for nc in others:
            await nc.close()


async def run_filtered(bus, trainer_version, groups):
    for g in groups:
        await bus.publish("train", g)
    trained: list[str] = []

    async def nothing(decision):
        return None

    async def count_drop(decision):
        await KvCounter(bus.state, GROUPS_DROPPED).add(1)

    async def handler(group: TrainGroup, delivery: Delivery):
        # The actor's admission step (`admit_fresh`), a drop counted in the run's counter.
        await admit_fresh(bus, group, trainer_version, nothing, count_drop)
        trained.append(group.group_id)

    worker = Worker(bus, "actor", handler, TrainGroup, WorkerOptions(fetch_timeout_s=0.2))
    counters = await worker.run(until_empty=True)
    return trained, counters


async def test_stale_filter_drops_past_the_bound_and_returns_credit(make_bus):
    bus = await make_bus(staleness={"max_staleness": 1, "action": "drop"})
    groups = [f.train(bus.run, i, version=v) for i, v in enumerate([5, 4, 3, 0])]
    trained, counters = await run_filtered(bus, 5, groups)
    assert trained == ["g0", "g1"] and counters.dropped == 2
    assert (await KvCounter(bus.state, GROUPS_DROPPED).get())[0] == 2
    events = [e for e in await read_all(bus, "events") if isinstance(e, RunEvent)]
    reasons = [e.fields["reason"] for e in events if e.event == "message_dropped"]
    assert reasons == [
        "stale: lag 2 > max_staleness 1 (trainer v5, sample v3)",
        "stale: lag 5 > max_staleness 1 (trainer v5, sample v0)",
    ]


async def test_stale_filter_requeues_then_drops_at_the_limit(make_bus):
    bus = await make_bus(staleness={"max_staleness": 0, "action": "requeue", "max_requeues": 1})
    groups = [f.train(bus.run, 0, version=2, attempt=0), f.train(bus.run, 1, version=2, attempt=1)]
    trained, counters = await run_filtered(bus, 3, groups)
    assert trained == [] and counters.skipped == 1 and counters.dropped == 1
    (again,) = await read_all(bus, "prompts")
    assert isinstance(again, PromptGroup) and again.group_id == "g0"
    assert again.attempt == 1 and again.released_at_version == 3
    kinds = [e.event for e in await read_all(bus, "events")]
    assert kinds == ["group_requeued", "message_dropped"]

"""The follower shape against a real server: a limits stream read in order, each message once, from a role's
durable (rewound to its ack floor, acknowledged per batch after the handler) or from an ordered consumer
starting at a sequence (no acks)."""

from __future__ import annotations

import asyncio

import pytest

from relax_bus.delivery import WorkerOptions
from relax_bus.follow import Followed, Follower
from relax_bus.heartbeat import live_workers
from schemas import RunEvent
from tests.waiting import until

pytestmark = pytest.mark.bus


async def publish_events(bus, numbers) -> None:
    for n in numbers:
        await bus.publish("events", RunEvent(run=bus.run, event="step_trained", fields={"step": n}))


def steps(batch: list[Followed]) -> list[int]:
    return [int(m.fields["step"]) for _, m in batch if isinstance(m, RunEvent)]


async def events_info(bus):
    return await bus.js.consumer_info(bus.topology.stream("events").name, "metrics")


async def test_a_role_follows_its_durable_in_order_and_acks_each_batch_after_its_handler(bus):
    await publish_events(bus, range(1, 6))
    handled: list[int] = []
    acked_before_handler: list[int] = []

    async def handle(batch: list[Followed]) -> None:
        acked_before_handler.append(int((await events_info(bus)).ack_floor.stream_seq or 0))
        handled.extend(steps(batch))

    follower = Follower.for_role(bus, "metrics", handle, options=WorkerOptions(fetch_timeout_s=0.2))
    stop = asyncio.Event()
    running = asyncio.create_task(follower.run(stop=stop))
    await until(lambda: handled, lambda h: h == [1, 2, 3, 4, 5], 30, "the five events handled")
    await until(lambda: live_workers(bus.workers), lambda b: any(w.role == "metrics" for w in b), 30, "heartbeat")
    await publish_events(bus, [6])
    await until(lambda: handled, lambda h: h[-1:] == [6], 30, "a later event")
    info = await until(lambda: events_info(bus), lambda i: i.ack_floor.stream_seq == 6, 30, "every event acked")
    assert info.num_ack_pending == 0 and acked_before_handler[0] == 0
    stop.set()
    counters = await asyncio.wait_for(running, 30)
    assert handled == [1, 2, 3, 4, 5, 6] and counters.received == counters.processed == 6
    assert not [w for w in await live_workers(bus.workers) if w.role == "metrics"], "the heartbeat is removed"
    # Limits retention: following took nothing away from the stream.
    assert (await bus.js.stream_info(bus.topology.stream("events").name)).state.messages == 6


async def test_what_a_dead_reader_took_without_acking_comes_again_at_once_and_in_order(bus):
    await publish_events(bus, range(1, 5))
    first = Follower.for_role(bus, "metrics", options=WorkerOptions(fetch_timeout_s=0.2))
    async with first.reading():
        taken: list[Followed] = []
        while len(taken) < 4:
            taken += await first.next_batch()
        await first.acknowledge()  # 1-4 are done with
        await publish_events(bus, range(5, 8))
        more: list[Followed] = []
        while len(more) < 3:
            more += await first.next_batch()  # 5-7 taken, and the reader "dies" before acknowledging them
    assert steps(taken) == [1, 2, 3, 4] and steps(more) == [5, 6, 7]

    # ack_wait is 5 s in these runs: without the rewind, 5-7 would come only after it.
    second = Follower.for_role(bus, "metrics", options=WorkerOptions(fetch_timeout_s=0.2))
    async with second.reading():
        again = await asyncio.wait_for(second.next_batch(), 3)
    assert steps(again) == [5, 6, 7] and [seq for seq, _ in again] == [5, 6, 7]


async def test_an_ordered_follower_starts_at_a_sequence_acks_nothing_and_passes_unreadable_entries_over(bus):
    await publish_events(bus, range(1, 4))
    await bus.js.publish(bus.topology.subject("events"), b"not a message")  # seq 4
    await publish_events(bus, [5])
    follower = Follower.ordered(bus, "events", from_seq=2)
    async with follower.reading():
        got: list[Followed] = []
        while len(got) < 4:
            got += await follower.next_batch(timeout_s=2)
    assert [seq for seq, _ in got] == [2, 3, 4, 5]
    assert steps(got) == [2, 3, 5] and got[2].message is None  # the entry that does not decode
    info = await events_info(bus)
    assert info.num_pending == 5 and info.ack_floor.stream_seq == 0, "the role's durable is untouched"


async def test_an_ordered_follower_reads_by_direct_get_in_batches_without_a_consumer(bus):
    follower = Follower.ordered(bus, "events", batch=2)
    async with follower.reading():
        await publish_events(bus, [1, 2, 3, 4, 5])
        got: list[Followed] = []
        while len(got) < 5:
            batch = await follower.next_batch(timeout_s=2)
            assert len(batch) <= 2
            got += batch
        await publish_events(bus, [6])
        got += await follower.next_batch(timeout_s=2)
        assert await follower.next_batch(timeout_s=0.3) == []
        info = await bus.js.stream_info(bus.topology.stream("events").name)
    assert steps(got) == [1, 2, 3, 4, 5, 6]
    provisioned = sum(c.stream_key == "events" for c in bus.topology.consumers)  # the metrics role's durable
    assert info.state.consumer_count == provisioned, "read by direct get: no consumer of its own"


async def test_a_stop_wakes_an_ordered_follower_waiting_for_messages(bus):
    seen: list[int] = []

    async def handle(batch: list[Followed]) -> None:
        seen.extend(steps(batch))

    follower = Follower.ordered(bus, "events", handle, options=WorkerOptions(fetch_timeout_s=60))  # long waits
    stop = asyncio.Event()
    running = asyncio.create_task(follower.run(stop=stop))
    await publish_events(bus, [1])
    await until(lambda: seen, lambda s: s == [1], 10, "the event handled")
    stop.set()
    await until(lambda: running.done(), bool, 5, "the follower stopped at once, not after its 60 s wait")
    assert running.result().received == 1
    assert await live_workers(bus.workers) == [], "a follower of no role keeps no heartbeat"

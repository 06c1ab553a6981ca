"""The two loop shapes besides the per-message worker, against a real server: the batch worker (the
actor's) and the source (the feeder's). Settling goes through the same code as the worker loop."""

import asyncio
import json

import pytest

from relax_bus.batch_worker import BatchWorker
from relax_bus.control import Drop, Reject, Skip
from relax_bus.delivery import WorkerOptions
from relax_bus.fetch import fetch_at_most
from relax_bus.source import Source
from schemas import DeadLetter, TrainGroup
from tests import factories as f
from tests.bus.test_publish import read_all
from tests.waiting import until

pytestmark = pytest.mark.bus


class Recorder:
    """A batch role that holds fresh groups, skips copies, drops `stale` and rejects `bad` indices."""

    def __init__(self, stale=(), bad=(), batches=2, fail_first=False):
        self.stale, self.bad, self.batches, self.fail_first = set(stale), set(bad), batches, fail_first
        self.handled: list[list[int]] = []
        self.done: list[list[int]] = []
        self.seen: set[int] = set()
        self.worker: BatchWorker | None = None

    async def admit(self, group, delivery, held):
        index = group.scored.rollout.prompt.release_index
        if index in self.seen or any(h.message.scored.rollout.prompt.release_index == index for h in held):
            raise Skip()
        if index in self.stale:
            raise Drop(f"group {index} is stale")
        if index in self.bad:
            raise Reject(f"group {index} is bad")

    async def handle(self, batch):
        if self.fail_first:
            self.fail_first = False
            raise RuntimeError("the trainer failed once")
        self.handled.append(sorted(h.message.scored.rollout.prompt.release_index for h in batch))

    async def settled(self, batch):
        indices = sorted(h.message.scored.rollout.prompt.release_index for h in batch)
        self.seen.update(indices)
        self.done.append(indices)
        if len(self.done) == self.batches:
            self.worker.stop()


def batch_worker(bus, role):
    worker = BatchWorker(bus, "actor", role, TrainGroup, lambda: 2, WorkerOptions(fetch_timeout_s=0.2))
    role.worker = worker
    return worker


async def train_info(bus):
    return await bus.js.consumer_info(bus.topology.stream("train").name, "actor")


async def test_batches_are_handled_once_then_acked_and_copies_drops_and_rejects_are_settled(bus):
    for i in (0, 1, 1, 2, 3, 4, 5):  # index 1 twice (a copy), 2 stale, 3 bad
        await bus.publish("train", f.train(bus.run, i), msg_id=f"t{i}-{asyncio.get_running_loop().time()}")
    role = Recorder(stale={2}, bad={3})
    counters = await asyncio.wait_for(batch_worker(bus, role).run(), 60)
    assert role.handled == role.done == [[0, 1], [4, 5]]
    assert (counters.processed, counters.skipped, counters.dropped, counters.dead_lettered) == (4, 1, 1, 1)
    letters = await read_all(bus, "dlq")
    assert [d.reason for d in letters if isinstance(d, DeadLetter)] == ["group 3 is bad"]
    info = await until(lambda: train_info(bus), lambda i: i.num_ack_pending == 0, 30, "every train message settled")
    assert info.num_pending == 0 and info.num_redelivered == 0


async def test_a_stop_or_a_failing_handle_hands_the_held_messages_back(bus):
    await bus.publish("train", f.train(bus.run, 0))
    role = Recorder(batches=1)
    worker = batch_worker(bus, role)
    running = asyncio.create_task(worker.run())
    await until(lambda: worker.counters.received, lambda n: n == 1, 30, "the first group held")
    worker.stop()  # half a batch held: handed back, not lost
    await asyncio.wait_for(running, 30)
    assert role.handled == []

    await bus.publish("train", f.train(bus.run, 1))
    failing = Recorder(batches=1, fail_first=True)
    with pytest.raises(RuntimeError, match="the trainer failed once"):
        await asyncio.wait_for(batch_worker(bus, failing).run(), 60)
    again = Recorder(batches=1)
    deliveries = {}
    admit = again.admit

    async def recording(group, delivery, held):
        deliveries[group.scored.rollout.prompt.release_index] = delivery.deliveries
        await admit(group, delivery, held)

    again.admit = recording
    await asyncio.wait_for(batch_worker(bus, again).run(), 60)  # both come back and are handled once
    assert again.handled == [[0, 1]]
    assert deliveries == {0: 3, 1: 2}  # 0: held at the stop, then in the failed batch; 1: the failed batch
    assert await read_all(bus, "dlq") == []
    info = await until(lambda: train_info(bus), lambda i: i.num_ack_pending == 0, 30, "both acked")
    assert info.num_pending == 0


class Gated(Recorder):
    """A Recorder whose first `handle` waits for `gate`, recording the order of admits and handles."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = asyncio.Event()
        self.handling = False
        self.admitted: list[int] = []

    async def admit(self, group, delivery, held):
        await super().admit(group, delivery, held)
        self.admitted.append(group.scored.rollout.prompt.release_index)

    async def handle(self, batch):
        self.handling = True
        await self.gate.wait()
        await super().handle(batch)


async def test_the_next_batch_is_read_while_one_is_handled_and_admitted_after_it(bus):
    for i in (0, 1):
        await bus.publish("train", f.train(bus.run, i))
    role = Gated(batches=2)
    worker = batch_worker(bus, role)
    running = asyncio.create_task(worker.run())
    await until(lambda: role.handling, bool, 30, "the first batch in handle")
    for i, msg_id in ((2, "t2"), (0, "t0-copy"), (3, "t3")):  # a copy of a group in the batch being handled
        await bus.publish("train", f.train(bus.run, i), msg_id=msg_id)
    # One batch ahead: two more read and decoded during handle, but judged only once the batch is settled.
    await until(lambda: worker.counters.received, lambda n: n == 4, 30, "the next batch read during handle")
    assert role.admitted == [0, 1]
    role.gate.set()
    counters = await asyncio.wait_for(running, 60)
    assert role.handled == [[0, 1], [2, 3]]
    assert role.admitted == [0, 1, 2, 3] and counters.skipped == 1  # the copy judged against the settled batch
    info = await until(lambda: train_info(bus), lambda i: i.num_ack_pending == 0, 30, "every train message settled")
    assert info.num_pending == 0 and info.num_redelivered == 0


async def test_without_read_ahead_the_next_batch_stays_on_the_server_while_one_is_handled(bus):
    for i in (0, 1):
        await bus.publish("train", f.train(bus.run, i))
    role = Gated(batches=2)
    options = WorkerOptions(fetch_timeout_s=0.2)
    role.worker = worker = BatchWorker(bus, "actor", role, TrainGroup, lambda: 2, options, read_ahead=False)
    running = asyncio.create_task(worker.run())
    await until(lambda: role.handling, bool, 30, "the first batch in handle")
    for i in (2, 3):
        await bus.publish("train", f.train(bus.run, i))
    # No pull is waiting while the batch is handled (a CPU trainer's cores are busy): the server keeps them.
    await until(lambda: train_info(bus), lambda i: i.num_pending == 2 and i.num_waiting == 0, 30, "kept")
    assert worker.counters.received == 2
    role.gate.set()
    await asyncio.wait_for(running, 60)
    assert role.handled == [[0, 1], [2, 3]]


async def test_with_flush_idle_s_the_batch_is_what_is_held_once_the_input_runs_dry(bus):
    for i in (0, 1, 2):
        await bus.publish("train", f.train(bus.run, i))
    role = Recorder(batches=2)
    options = WorkerOptions(fetch_timeout_s=0.2)
    role.worker = worker = BatchWorker(bus, "actor", role, TrainGroup, lambda: 5, options, flush_idle_s=0.5)
    running = asyncio.create_task(worker.run())
    await until(lambda: asyncio.sleep(0, role.handled), bool, 30, "the first, partial batch handled")
    assert role.handled == [[0, 1, 2]]  # three of five, once nothing more came
    info = await until(lambda: train_info(bus), lambda i: i.num_ack_pending == 0, 30, "the partial batch acked")
    assert info.num_pending == 0
    for i in (3, 4):
        await bus.publish("train", f.train(bus.run, i))
    await asyncio.wait_for(running, 60)
    assert role.handled == role.done == [[0, 1, 2], [3, 4]]


class Counting:
    """A source role releasing `total` prompt groups, `per` at a time."""

    def __init__(self, bus, total, per):
        self.bus, self.total, self.per = bus, total, per
        self.released = 0
        self.wake = asyncio.Event()
        self.published_batches: list[int] = []

    async def produce(self):
        if self.released >= self.total:
            return None
        n = min(self.per, self.total - self.released)
        return [f.prompt(self.bus.run, self.released + i) for i in range(n)]

    async def published(self, batch):
        self.released += len(batch)
        self.published_batches.append(len(batch))


async def test_a_source_publishes_until_done_and_a_full_hop_only_delays_it(make_bus):
    bus = await make_bus(groups_per_step=2, bus={"hop_max_msgs": 3, "max_ack_pending": 2})
    role = Counting(bus, total=5, per=2)
    source = Source(bus, "feeder", role, WorkerOptions(), poll_s=0.05, publish_deadline_s=0.5)
    running = asyncio.create_task(source.run())
    await until(lambda: role.released, lambda n: n >= 2, 30, "the first batch")
    await until(lambda: source.counters.output_full, lambda n: n >= 1, 30, "the hop full")
    assert role.released < 5 and not running.done()
    sub = await bus.js.pull_subscribe_bind("rollout", bus.topology.stream("prompts").name)
    taken = []
    while len(taken) < 5:  # consuming makes room; the same ids are published again, stored once
        for msg in await sub.fetch(5, timeout=5):
            taken.append(msg.metadata.sequence.stream)
            await msg.ack_sync()
    await asyncio.wait_for(running, 30)
    assert role.released == 5 and source.counters.published == 5
    info = await bus.js.stream_info(bus.topology.stream("prompts").name)
    assert info.state.messages == 0 and len(taken) == 5  # five stored, five consumed: no duplicates


async def test_a_pull_takes_at_most_what_it_asked_for_and_hands_back_the_surplus(bus):
    """An earlier fetch's pull request still held by the server (as after an election) fills the
    subscription's queue; nats-py's fetch(2) then returns all of it. A batch of 2 must hold 2."""
    sub = await bus.js.pull_subscribe_bind("actor", bus.topology.stream("train").name)
    orphan = {"batch": 5, "expires": 30_000_000_000}
    # the request a fetch sends (nats-py keeps its subjects private)
    await bus.nc.publish(sub._nms, json.dumps(orphan).encode(), reply=sub._deliver)
    for i in range(5):
        await bus.publish("train", f.train(bus.run, i))
    await until(lambda: asyncio.sleep(0, sub.pending_msgs), lambda n: n == 5, 30, "five queued by the old request")
    first = await fetch_at_most(sub, 2, timeout_s=2)
    assert [m.metadata.sequence.stream for m in first] == [1, 2]
    rest = []
    while len(rest) < 3:  # the three handed back come again
        rest += await fetch_at_most(sub, 5, timeout_s=2)
    assert sorted(m.metadata.sequence.stream for m in rest) == [3, 4, 5]
    assert all(m.metadata.num_delivered == 2 for m in rest)
    for m in first + rest:
        await m.ack_sync()
    # A reader that takes any number (and must keep stream order) gets the whole queue instead.
    await bus.nc.publish(sub._nms, json.dumps(orphan).encode(), reply=sub._deliver)
    for i in range(5, 8):
        await bus.publish("train", f.train(bus.run, i))
    await until(lambda: asyncio.sleep(0, sub.pending_msgs), lambda n: n == 3, 30, "three queued by the old request")
    whole = await fetch_at_most(sub, 2, timeout_s=2, keep_surplus=True)
    assert [m.metadata.sequence.stream for m in whole] == [6, 7, 8]
    for m in whole:
        await m.ack_sync()
    info = await train_info(bus)
    assert info.num_ack_pending == 0 and info.num_pending == 0

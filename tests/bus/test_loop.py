"""The loop base every shape shares, against a real server: the heartbeat (`<role>.<worker id>`, counters, the
policy version), `alive()` for a role's setup, `run(stop=event)`, the batch shape's rewind, and the log context
(`run`, `role`, `worker`) a loop that runs for a role gives its events."""

from __future__ import annotations

import asyncio

import pytest
import structlog
from structlog.testing import capture_logs

from relax_bus.delivery import WorkerOptions, role_worker
from relax_bus.follow import Follower
from relax_bus.heartbeat import live_workers
from relax_bus.log import get_logger
from relax_bus.source import Source
from relax_bus.worker import Worker
from schemas import PromptGroup
from tests import factories as f
from tests.bus.test_batch_and_source import Counting, Recorder, batch_worker
from tests.waiting import until

pytestmark = pytest.mark.bus


async def beats(bus, role: str):
    return [w for w in await live_workers(bus.workers) if w.role == role]


async def test_a_worker_runs_until_the_roles_stop_event_is_set_and_its_heartbeat_goes_with_it(bus):
    async def handle(prompt, delivery):
        return None

    worker = Worker(bus, "rollout", handle, PromptGroup, WorkerOptions(fetch_timeout_s=0.2))
    worker.policy_version = 7
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop=stop))
    await bus.publish("prompts", f.prompt(bus.run, 0))
    await until(lambda: worker.counters.processed, lambda n: n == 1, 30, "the prompt handled")
    [beat] = await until(
        lambda: beats(bus, "rollout"), lambda b: b and b[0].counters.get("processed") == 1, 30, "a fresh heartbeat"
    )
    assert beat.worker_id == worker.worker_id and beat.policy_version == 7
    stop.set()
    await asyncio.wait_for(running, 30)
    assert await beats(bus, "rollout") == []


async def test_alive_beats_from_a_roles_setup_through_its_loop_and_ends_with_the_outer_block(bus):
    worker = batch_worker(bus, Recorder(batches=1))
    worker.counts["warmup_steps"] = 3  # the role's own counts, beside the loop's counters
    async with worker.alive():
        [beat] = await beats(bus, "actor")  # written before the block's body: a warm-up can take minutes
        assert beat.counters["warmup_steps"] == 3 and beat.counters["processed"] == 0
        for i in (0, 1):
            await bus.publish("train", f.train(bus.run, i))
        await asyncio.wait_for(worker.run(), 60)
        [beat] = await beats(bus, "actor")  # the loop ended; the block goes on beating
        assert beat.worker_id == worker.worker_id
    assert await beats(bus, "actor") == []


async def test_a_source_stops_when_the_roles_stop_event_is_set(bus):
    role = Counting(bus, total=10**6, per=1)
    source = Source(bus, "feeder", role, WorkerOptions(), poll_s=0.05, publish_deadline_s=0.5)
    stop = asyncio.Event()
    running = asyncio.create_task(source.run(stop=stop))
    await until(lambda: role.released, lambda n: n >= 1, 30, "a first release")
    await until(lambda: beats(bus, "feeder"), bool, 30, "the feeder's heartbeat")
    stop.set()
    counters = await asyncio.wait_for(running, 30)
    assert counters.published == role.released < 10**6
    assert await beats(bus, "feeder") == []


async def test_a_batch_worker_rewound_to_a_sequence_is_delivered_everything_after_it_again(bus):
    for i in range(4):
        await bus.publish("train", f.train(bus.run, i))
    first = Recorder(batches=2)
    await asyncio.wait_for(batch_worker(bus, first).run(), 60)
    assert first.done == [[0, 1], [2, 3]]

    again = Recorder(batches=1)
    worker = batch_worker(bus, again)
    assert await worker.rewind(3) == 3  # as from a checkpoint whose ack floor was 2
    await bus.publish("train", f.train(bus.run, 4))
    await asyncio.wait_for(worker.run(), 60)
    assert again.done == [[2, 3]]


async def test_the_log_events_of_a_roles_loop_and_its_handlers_carry_run_role_and_worker(bus):
    handler_log = get_logger("tests.handler")

    async def handle(prompt, delivery):
        handler_log.info("handled_in_test", group=prompt.group_id)
        await asyncio.to_thread(handler_log.info, "handled_in_thread")  # a handler's blocking part, in a thread
        return None

    worker = Worker(bus, "rollout", handle, PromptGroup, WorkerOptions(fetch_timeout_s=0.2))
    stop = asyncio.Event()
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as events:
        running = asyncio.create_task(worker.run(stop=stop))
        await bus.publish("prompts", f.prompt(bus.run, 0))
        await until(lambda: worker.counters.processed, lambda n: n == 1, 30, "the prompt handled")
        stop.set()
        await asyncio.wait_for(running, 30)
        handler_log.info("after_the_loop")
    by_name = {e["event"]: e for e in events}
    whose = {"run": bus.run, "role": "rollout", "worker": worker.worker_id}
    for name in ("worker_started", "handled_in_test", "handled_in_thread", "worker_stopped"):
        assert whose.items() <= by_name[name].items(), by_name.get(name, events)
    assert not {"run", "role", "worker"} & by_name["after_the_loop"].keys(), "the context outlived the loop"


async def test_a_roles_setup_in_alive_logs_with_its_worker_id_and_a_loop_for_no_role_binds_nothing(bus):
    worker = batch_worker(bus, Recorder(batches=1))
    setup_log = get_logger("tests.setup")
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as events:
        async with worker.alive():  # the actor's warm-up runs here, before its loop
            setup_log.info("warming_up")
        async with Follower.ordered(bus, "events").alive():  # `relax run`'s: no heartbeat, no role
            setup_log.info("no_role")
    warming, no_role = (e for e in events if e["event"] in ("warming_up", "no_role"))
    assert {"run": bus.run, "role": "actor", "worker": worker.worker_id}.items() <= warming.items(), warming
    assert not {"run", "role", "worker"} & no_role.keys(), no_role


async def test_a_role_process_is_one_worker_whose_id_its_loop_takes_and_every_event_carries(bus):
    role_log = get_logger("tests.role")

    async def handle(prompt, delivery):
        role_log.info("handled_in_test")
        return None

    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as events:
        with role_worker(bus.run, "rollout") as worker_id:  # what `relax worker rollout` does first
            role_log.info("loading_the_model")  # before any loop, as a role's setup
            worker = Worker(bus, "rollout", handle, PromptGroup, WorkerOptions(fetch_timeout_s=0.2))
            assert worker.worker_id == worker_id
            stop = asyncio.Event()
            running = asyncio.create_task(worker.run(stop=stop))
            await bus.publish("prompts", f.prompt(bus.run, 0))
            [beat] = await until(lambda: beats(bus, "rollout"), bool, 30, "the worker's heartbeat")
            assert beat.worker_id == worker_id
            await until(lambda: worker.counters.processed, lambda n: n == 1, 30, "the prompt handled")
            stop.set()
            await asyncio.wait_for(running, 30)
        role_log.info("after_the_role")
        assert WorkerOptions().worker_id != worker_id, "a loop outside the role's block gets an id of its own"
    by_name = {e["event"]: e for e in events}
    whose = {"run": bus.run, "role": "rollout", "worker": worker_id}
    for name in ("loading_the_model", "worker_started", "handled_in_test", "worker_stopped"):
        assert whose.items() <= by_name[name].items(), by_name.get(name, events)
    assert not {"run", "role", "worker"} & by_name["after_the_role"].keys(), "the context outlived the role"

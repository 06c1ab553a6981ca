import asyncio

import msgpack
import pytest

from relax_bus.control import Drop, Reject, Retry, Skip
from relax_bus.worker import Worker, WorkerOptions
from schemas import DeadLetter, PromptGroup, RunEvent, encode
from tests import factories as f
from tests.bus.test_publish import read_all

pytestmark = pytest.mark.bus


async def publish_prompts(bus, n):
    for i in range(n):
        await bus.publish("prompts", f.prompt(bus.run, i))


async def consumer_state(bus, key="prompts"):
    c = bus.topology.consumer(key)
    return await bus.js.consumer_info(bus.topology.stream(key).name, c.durable)


def rollout_worker(bus, handler, **options):
    return Worker(bus, "rollout", handler, PromptGroup, WorkerOptions(fetch_timeout_s=0.2, **options))


async def echo(prompt, delivery):
    return f.rollout(prompt)


async def test_handler_outputs_are_published_and_inputs_acked(bus):
    await publish_prompts(bus, 5)
    counters = await rollout_worker(bus, echo, concurrency=3).run(until_empty=True)
    assert counters.processed == 5 and counters.published == 5
    outs = await read_all(bus, "rollouts")
    assert sorted(o.prompt.group_id for o in outs) == [f"g{i}" for i in range(5)]
    state = await consumer_state(bus)
    assert state.num_pending == 0 and state.num_ack_pending == 0


async def test_bad_messages_go_to_dlq_and_the_worker_keeps_going(bus):
    subject = bus.topology.subject("prompts")
    await bus.publish("prompts", f.prompt(bus.run, 0))
    await bus.js.publish(subject, b"\xc1garbage", headers={"Nats-Msg-Id": "bad-1"})
    future = msgpack.unpackb(encode(f.prompt(bus.run, 99)), raw=False)
    future["schema_version"] = "9.0"
    await bus.js.publish(subject, msgpack.packb(future, use_bin_type=True), headers={"Nats-Msg-Id": "bad-2"})
    await bus.publish("prompts", f.prompt(bus.run, 1))

    counters = await rollout_worker(bus, echo).run(until_empty=True)

    assert counters.processed == 2 and counters.dead_lettered == 2
    letters = await read_all(bus, "dlq")
    assert all(isinstance(d, DeadLetter) for d in letters)
    reasons = [d.reason for d in letters]
    assert "not valid msgpack" in reasons[0]
    assert "prompt_group schema version 9.0 is not supported" in reasons[1]
    assert letters[0].payload == b"\xc1garbage" and letters[0].source_subject == subject
    assert letters[0].stream_seq == 2 and letters[0].consumer == "rollout"
    assert len(await read_all(bus, "rollouts")) == 2


async def test_retry_is_redelivered(bus):
    await publish_prompts(bus, 3)
    seen: list[tuple[str, int]] = []

    async def flaky(prompt, delivery):
        seen.append((prompt.group_id, delivery.deliveries))
        if prompt.group_id == "g1" and delivery.deliveries == 1:
            raise Retry(0.2, "engine busy")
        return f.rollout(prompt)

    counters = await rollout_worker(bus, flaky).run(until_empty=True)
    assert counters.retried == 1 and counters.processed == 3
    assert ("g1", 1) in seen and ("g1", 2) in seen
    assert (await consumer_state(bus)).num_redelivered == 0  # all settled now
    assert len(await read_all(bus, "rollouts")) == 3


async def test_drop_terminates_and_is_counted(bus):
    await publish_prompts(bus, 3)

    async def picky(prompt, delivery):
        if prompt.group_id == "g2":
            raise Drop("prompt too long")
        return f.rollout(prompt)

    counters = await rollout_worker(bus, picky).run(until_empty=True)
    assert counters.dropped == 1 and counters.processed == 2
    events = [e for e in await read_all(bus, "events") if isinstance(e, RunEvent)]
    assert [(e.event, e.fields["reason"], e.fields["group_id"]) for e in events] == [
        ("message_dropped", "prompt too long", "g2")
    ]
    state = await consumer_state(bus)
    assert state.num_pending == 0 and state.num_ack_pending == 0
    assert (await bus.js.stream_info(bus.topology.stream("prompts").name)).state.messages == 0


async def test_skip_acks_without_output(bus):
    await publish_prompts(bus, 2)

    async def skipper(prompt, delivery):
        raise Skip()

    counters = await rollout_worker(bus, skipper).run(until_empty=True)
    assert counters.skipped == 2 and counters.published == 0
    assert await read_all(bus, "rollouts") == []


async def test_a_message_that_keeps_failing_lands_in_dlq_after_max_deliver(bus):
    await publish_prompts(bus, 1)
    calls = []

    async def broken(prompt, delivery):
        calls.append(delivery.deliveries)
        raise ValueError("boom")

    counters = await rollout_worker(bus, broken, retry_backoff_s=(0.05,)).run(until_empty=True)
    assert calls == [1, 2, 3]  # max_deliver is 3 in the test config
    assert counters.failed == 3 and counters.dead_lettered == 1
    (letter,) = await read_all(bus, "dlq")
    assert letter.reason == "failed 3 times, last: ValueError: boom" and letter.deliveries == 3


async def test_retry_on_the_last_delivery_dead_letters(bus):
    await publish_prompts(bus, 1)

    async def never_ready(prompt, delivery):
        raise Retry(0.05, "weights not loaded")

    counters = await rollout_worker(bus, never_ready).run(until_empty=True)
    assert counters.retried == 2 and counters.dead_lettered == 1
    (letter,) = await read_all(bus, "dlq")
    assert letter.reason == "gave up after 3 deliveries: weights not loaded"


async def test_long_handler_is_kept_alive_past_ack_wait(make_bus):
    bus = await make_bus(bus={"ack_wait_s": 1.0})
    await publish_prompts(bus, 1)
    calls = []

    async def slow(prompt, delivery):
        calls.append(delivery.deliveries)
        await asyncio.sleep(2.5)
        return f.rollout(prompt)

    counters = await rollout_worker(bus, slow).run(until_empty=True)
    assert calls == [1] and counters.processed == 1
    assert (await consumer_state(bus)).num_redelivered == 0


async def test_a_message_whose_worker_died_on_its_last_delivery_is_reaped(make_bus):
    bus = await make_bus(bus={"ack_wait_s": 1.0, "max_deliver": 2})
    await publish_prompts(bus, 1)
    sub = await bus.js.pull_subscribe_bind("rollout", bus.topology.stream("prompts").name)
    for _ in range(2):  # two deliveries that are never settled, as if each worker was SIGKILLed
        (msg,) = await sub.fetch(1, timeout=5)
        assert msg.metadata.num_delivered in (1, 2)
    await sub.unsubscribe()

    worker = rollout_worker(bus, echo)
    task = asyncio.create_task(worker.run())
    try:
        for _ in range(100):
            if worker.counters.dead_lettered:
                break
            await asyncio.sleep(0.1)
    finally:
        worker.stop()
        await task
    (letter,) = await read_all(bus, "dlq")
    assert letter.reason.startswith("not settled after 2 deliveries") and letter.stream_seq == 1
    assert (await bus.js.stream_info(bus.topology.stream("prompts").name)).state.messages == 0
    assert worker.counters.processed == 0


async def test_reject_dead_letters_at_once_with_the_reason(bus):
    await publish_prompts(bus, 2)

    async def strict(prompt, delivery):
        if prompt.group_id == "g0":
            raise Reject("prompt g0 can never be generated")
        return f.rollout(prompt)

    counters = await rollout_worker(bus, strict).run(until_empty=True)
    assert (counters.dead_lettered, counters.processed, counters.retried, counters.failed) == (1, 1, 0, 0)
    (letter,) = await read_all(bus, "dlq")
    assert letter.reason == "prompt g0 can never be generated" and letter.deliveries == 1
    assert (await consumer_state(bus)).num_ack_pending == 0

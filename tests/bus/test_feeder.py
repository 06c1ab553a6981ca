"""The feeder against a real server: the credit rule, late drops replaced, done only when the trainer is."""

import asyncio

import pytest

from relax_bus.kv_counter import KvCounter
from schemas import DeadLetter, PromptGroup, encode
from tests.bus.test_publish import read_all
from tests.waiting import holds, until
from workers.roles.feeder import feed
from workers.state_keys import FEEDER_CURSOR, GROUPS_DROPPED, TRAINER_DONE

pytestmark = pytest.mark.bus


async def cursor(bus) -> int:
    return (await KvCounter(bus.state, FEEDER_CURSOR).get())[0]


async def wait_cursor(bus, value: int, timeout_s: float = 60.0) -> None:
    await until(lambda: cursor(bus), lambda c: c == value, timeout_s, f"feeder cursor {value}")


async def cursor_stays(bus, value: int, for_s: float = 1.0) -> None:
    """The feeder releases nothing more for a while (several of its polls): the credit rule holds it."""
    await holds(lambda: cursor(bus), lambda c: c == value, for_s, f"feeder cursor held at {value}")


async def test_feeder_follows_the_credit_rule_and_replaces_late_drops(make_bus):
    bus = await make_bus(
        groups_per_step=2,
        staleness={"max_staleness": 0},
        task={"type": "addition", "options": {"seed": 3}},
        trainer={"steps": 3},
    )
    stop = asyncio.Event()
    task = asyncio.create_task(feed(bus, stop))
    try:
        await wait_cursor(bus, 2)  # on-policy: one step's groups at version 0
        await cursor_stays(bus, 2)
        revision = await bus.version.advance(1, 0)
        await wait_cursor(bus, 4)
        revision = await bus.version.advance(2, revision)
        await wait_cursor(bus, 6)  # every step covered; the feeder stays for late drops
        await holds(task.done, lambda done: not done, 1.0, "feeder running")
        await bus.state.put(GROUPS_DROPPED, b"1")
        await wait_cursor(bus, 7)
        await bus.state.put(TRAINER_DONE, b"3")
        assert await asyncio.wait_for(task, 10) == 7
    finally:
        stop.set()
        if not task.done():
            task.cancel()
    prompts = [m for m in await read_all(bus, "prompts") if isinstance(m, PromptGroup)]
    assert [p.release_index for p in prompts] == list(range(7))
    assert [p.released_at_version for p in prompts] == [0, 0, 1, 1, 2, 2, 2]
    assert len({p.group_id for p in prompts}) == 7


async def test_feeder_stops_on_request_and_resumes_from_its_cursor(make_bus):
    bus = await make_bus(
        groups_per_step=2,
        staleness={"max_staleness": "unbounded"},
        task={"type": "addition", "options": {"seed": 3}},
        trainer={"steps": 2},
    )
    stop = asyncio.Event()
    first = asyncio.create_task(feed(bus, stop))
    await wait_cursor(bus, 4)
    stop.set()
    assert await asyncio.wait_for(first, 10) == 4
    await bus.state.put(GROUPS_DROPPED, b"2")
    again = asyncio.create_task(feed(bus, asyncio.Event()))
    await wait_cursor(bus, 6)
    await bus.state.put(TRAINER_DONE, b"2")
    assert await asyncio.wait_for(again, 10) == 6
    prompts = [m for m in await read_all(bus, "prompts") if isinstance(m, PromptGroup)]
    assert [p.release_index for p in prompts] == list(range(6))


async def test_a_dead_lettered_group_is_replaced_and_garbage_earns_nothing(make_bus):
    bus = await make_bus(
        groups_per_step=2,
        staleness={"max_staleness": "unbounded"},
        task={"type": "addition", "options": {"seed": 3}},
        trainer={"steps": 1},
    )
    stop = asyncio.Event()
    task = asyncio.create_task(feed(bus, stop))
    try:
        await wait_cursor(bus, 2)
        first = next(m for m in await read_all(bus, "prompts") if isinstance(m, PromptGroup))
        stream = bus.topology.stream("prompts").name
        # Dead-lettering takes the message off its hop; a group still on the bus earns no credit.
        await bus.js.delete_msg(stream, (await bus.js.stream_info(stream)).state.first_seq)
        letter = DeadLetter(run=bus.run, reason="test", source_subject="x", payload=encode(first))
        garbage = DeadLetter(run=bus.run, reason="test", source_subject="x", payload=b"\x00garbage")
        await bus.publish("dlq", garbage)
        await bus.publish("dlq", letter)
        await bus.publish("dlq", letter)  # the same group twice is one credit
        await wait_cursor(bus, 3)
        await cursor_stays(bus, 3)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)

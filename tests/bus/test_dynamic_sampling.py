"""Dynamic sampling against a real server: the reward role filters uniform groups (counted once however often
they come), and the feeder replaces them up to the over-sampling bound, then fails with an event."""

import asyncio

import pytest

import tests.factories as f
from relax_bus.control import Skip
from relax_bus.delivery import WorkerOptions
from relax_bus.errors import ConfigError
from relax_bus.kv_counter import KvCounter
from schemas import PromptGroup, RunEvent, TrainGroup
from tests.bus.test_publish import read_all
from tests.waiting import holds, until
from workers.roles.feeder import feed
from workers.roles.filtered_credit import OversampleExhausted, count_below, read_filtered, record_filtered
from workers.roles.reward import filter_uniform, make_scorer, reward_worker, score_group
from workers.state_keys import FEEDER_CURSOR

pytestmark = pytest.mark.bus

SAMPLING = {"drop_uniform": True, "max_oversample": 2.0}


def with_texts(run: str, i: int, texts: tuple[str, ...]):
    r = f.rollout(f.prompt(run, i, n=len(texts)))
    return r.model_copy(update={"samples": tuple(f.said(t) for t in texts)})


async def filtered_count(bus) -> int:
    bitmap, _ = await read_filtered(bus.state)
    return count_below(bitmap, len(bitmap) * 8)


async def events(bus, name: str) -> list[RunEvent]:
    return [e for e in await read_all(bus, "events") if isinstance(e, RunEvent) and e.event == name]


async def test_uniform_groups_are_filtered_once_and_the_rest_go_on(make_bus):
    bus = await make_bus(sampling=SAMPLING)
    run = bus.run
    informative = with_texts(run, 0, ("0", "1"))  # answer "1": rewards (0, 1)
    wrong = with_texts(run, 5, ("0", "1"))  # answer "6": (0, 0)
    right = with_texts(run, 6, ("7", "7"))  # answer "7": (1, 1)
    for r in (informative, wrong, right):
        await bus.publish("rollouts", r)
    worker = reward_worker(bus, WorkerOptions(fetch_timeout_s=0.2, grace_s=2))
    counters = await asyncio.wait_for(worker.run(until_empty=True), 60)

    assert (counters.processed, counters.skipped, counters.dead_lettered) == (1, 2, 0)
    assert [t.group_id for t in await read_all(bus, "train") if isinstance(t, TrainGroup)] == ["g0"]
    seen = {e.fields["group_id"]: e.fields for e in await events(bus, "group_filtered")}
    assert sorted(seen) == ["g5", "g6"]
    assert (seen["g5"]["reward"], seen["g5"]["release_index"]) == (0.0, 5)
    assert (seen["g6"]["reward"], seen["g6"]["release_index"]) == (1.0, 6)
    assert await filtered_count(bus) == 2

    # A redelivery of a filtered group (its worker died after the event, before the ack) is settled again and
    # announced again, but its credit is not counted twice.
    with pytest.raises(Skip):
        await filter_uniform(bus, score_group(make_scorer(bus), wrong), "again")
    assert await filtered_count(bus) == 2
    assert len(await events(bus, "group_filtered")) == 3
    # A copy of a filtered group sampled again with other texts is not trained either: it was replaced.
    copy = with_texts(run, 5, ("6", "0"))
    await bus.publish("rollouts", copy)
    counters = await asyncio.wait_for(reward_worker(bus).run(until_empty=True), 60)
    assert (counters.processed, counters.skipped) == (0, 1)
    assert [t.group_id for t in await read_all(bus, "train") if isinstance(t, TrainGroup)] == ["g0"]
    assert await filtered_count(bus) == 2


async def test_concurrent_records_of_the_same_groups_count_each_once(make_bus):
    bus = await make_bus()
    indices = [i for i in range(40) for _ in range(3)]  # every group three times, from many writers at once
    totals = await asyncio.gather(*(record_filtered(bus.state, i) for i in indices))
    assert await filtered_count(bus) == 40
    assert max(totals) == 40
    bitmap, _ = await read_filtered(bus.state)
    assert count_below(bitmap, 10) == 10


async def cursor(bus) -> int:
    return (await KvCounter(bus.state, FEEDER_CURSOR).get())[0]


async def wait_cursor(bus, value: int) -> None:
    await until(lambda: cursor(bus), lambda c: c == value, 60.0, f"feeder cursor {value}")


async def test_the_feeder_replaces_filtered_groups_up_to_the_bound_then_fails(make_bus):
    # 2 steps of 2 groups, max_oversample 2: at most 4 filtered groups are replaced (8 released in all).
    bus = await make_bus(
        groups_per_step=2,
        staleness={"max_staleness": 0},
        task={"type": "addition", "options": {"seed": 3}},
        trainer={"steps": 2},
        sampling=SAMPLING,
    )
    task = asyncio.create_task(feed(bus, asyncio.Event()))
    try:
        await wait_cursor(bus, 2)  # on-policy: one step's groups at version 0
        await record_filtered(bus.state, 0)
        await wait_cursor(bus, 3)  # a replacement for the filtered group
        await record_filtered(bus.state, 1)
        await record_filtered(bus.state, 2)
        await record_filtered(bus.state, 2)  # a redelivery: no second credit
        await wait_cursor(bus, 5)
        await holds(lambda: cursor(bus), lambda c: c == 5, 1.0, "feeder cursor held at 5")
        await record_filtered(bus.state, 3)
        await wait_cursor(bus, 6)  # 4 filtered: the bound, not past it
        assert not task.done()
        await record_filtered(bus.state, 4)  # the 5th: the run cannot train 4 groups within 8 releases
        with pytest.raises(OversampleExhausted, match=r"5 groups filtered .* more than the 4 that sampling"):
            await asyncio.wait_for(task, 10)
    finally:
        if not task.done():
            task.cancel()
    prompts = [m for m in await read_all(bus, "prompts") if isinstance(m, PromptGroup)]
    assert [p.release_index for p in prompts] == list(range(6))
    (failure,) = await events(bus, "oversample_exhausted")
    assert failure.level == "error"
    assert (failure.fields["filtered"], failure.fields["cap"], failure.fields["released"]) == (5, 4, 6)
    progress = [e.fields for e in await events(bus, "sampling_progress")]
    assert progress[-1] == {"released": 6, "filtered": 4, "filtered_fraction": round(4 / 6, 6)}


async def test_a_reward_role_refuses_to_filter_groups_of_one_sample(make_bus):
    bus = await make_bus(samples_per_group=1, sampling=SAMPLING)
    with pytest.raises(ConfigError, match="a group of one sample is always uniform"):
        reward_worker(bus)

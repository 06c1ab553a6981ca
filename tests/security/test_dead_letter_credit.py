"""Dead letters return credit to the feeder (a dead-lettered group is replaced). A forged letter must not
raise the release budget: only groups the feeder released itself earn credit, each once, and never more than
have left the pipeline without being trained, dropped or filtered (`workers.roles.dead_credit`)."""

from __future__ import annotations

import asyncio

import pytest

from relax_bus.kv_counter import KvCounter
from schemas import DeadLetter, PromptGroup, encode
from tests import factories as f
from tests.bus.test_auth import Secured, provisioned, secured  # noqa: F401 (`secured` is a fixture)
from tests.bus.test_publish import read_all
from tests.waiting import holds, until
from workers.roles.dead_credit import DeadLetterCredit, dead_credit
from workers.roles.feeder import feed
from workers.state_keys import FEEDER_CURSOR, TRAINER_DONE


def counted(n: int):
    """A `settled` reader that finds `n` groups settled."""

    async def settled() -> int:
        return n

    return settled


pytestmark = pytest.mark.bus


def released_id(index: int) -> str:
    """The id the feeder gave release `index` (the factory's naming)."""
    return f"g{index}"


def never_filtered(index: int) -> bool:
    return False


def letter_of(run: str, prompt: PromptGroup, seq: int = 0) -> DeadLetter:
    return DeadLetter(run=run, reason="forged?", source_subject="x", stream_seq=seq, payload=encode(prompt))


@pytest.mark.unit
def test_the_credit_is_bounded_by_the_groups_off_the_bus():
    assert dead_credit(letters=3, released=10, settled=4, on_bus=6) == 0  # every unsettled group is still held
    assert dead_credit(letters=3, released=10, settled=4, on_bus=4) == 2
    assert dead_credit(letters=1, released=10, settled=0, on_bus=0) == 1
    assert dead_credit(letters=5, released=10, settled=9, on_bus=3) == 0  # never negative


async def test_only_groups_the_feeder_released_earn_credit(bus):
    credit = await DeadLetterCredit(bus).start()
    try:
        letters = [
            f.prompt(bus.run, 3),  # honest: released as g3
            f.prompt(bus.run, 3),  # the same group again (a redelivered letter): no second credit
            f.prompt(bus.run, 999),  # never released
            f.prompt(bus.run, 4).model_copy(update={"group_id": "made-up"}),  # released index, wrong group
            f.prompt("another-run", 5),  # not this run's
        ]
        for seq, prompt in enumerate(letters, start=101):
            await bus.publish("dlq", letter_of(bus.run, prompt, seq))
        await until(lambda: len(credit.seen), lambda n: n >= 3, 10, "the letters to be read")
        assert credit.letters(10, released_id, never_filtered) == 1
        assert credit.letters(3, released_id, never_filtered) == 0, "index 3 is not released yet at a cursor of 3"
        assert credit.letters(1000, released_id, never_filtered) == 2, "once released, 999 is one of the feeder's"
        assert credit.letters(1000, released_id, lambda i: i == 3) == 1, "a filtered group has its own credit"
        assert await credit.credit(10, released_id, never_filtered, settled=counted(9)) == 1  # nothing on the bus
        assert await credit.credit(10, released_id, never_filtered, settled=counted(10)) == 0
    finally:
        await credit.stop()


async def cursor(bus) -> int:
    return (await KvCounter(bus.state, FEEDER_CURSOR).get())[0]


async def test_forged_dead_letters_do_not_raise_the_feeders_releases(secured: Secured):  # noqa: F811
    """The attack: with the rollout user's credentials, a dead letter for every group the feeder has released,
    in rounds. Before the bound each round's replacements were new indices the next round named (66 -> 322
    releases at version 0 in four rounds); now the groups are still on the bus, and nothing is credited. A real
    dead letter (its message gone from the hop, as the bus's dead-lettering leaves it) is still replaced."""
    admin = await provisioned(secured)
    attacker = await secured.bus("rollout")
    feeder = await secured.bus("feeder")
    cfg = secured.config
    budget = (0 + cfg.staleness.max_staleness + 1) * cfg.groups_per_step  # at version 0, nothing dropped
    stop = asyncio.Event()
    task = asyncio.create_task(feed(feeder, stop))
    try:
        await until(lambda: cursor(admin), lambda c: c == budget, 60, f"feeder cursor {budget}")
        for round_ in range(4):
            prompts = [m for m in await read_all(admin, "prompts") if isinstance(m, PromptGroup)]
            for p in prompts:
                await attacker.publish("dlq", letter_of(cfg.run, p, 1000 * round_ + p.release_index))
            await holds(lambda: cursor(admin), lambda c: c == budget, 1.5, f"feeder cursor held at {budget}")
        assert not task.done()

        # An honest dead letter: the stage's message is gone from the hop, its group never trains.
        stream = admin.topology.stream("prompts").name
        info = await admin.js.stream_info(stream)
        await admin.js.delete_msg(stream, info.state.first_seq)  # release 0: the feeder publishes in order
        gone = min(prompts, key=lambda p: p.release_index)
        await attacker.publish("dlq", letter_of(cfg.run, gone, 99_999))
        await until(lambda: cursor(admin), lambda c: c == budget + 1, 30, f"feeder cursor {budget + 1}")
        await holds(lambda: cursor(admin), lambda c: c == budget + 1, 1.0, "one replacement only")
        await admin.state.put(TRAINER_DONE, b"2")
        await asyncio.wait_for(task, 10)
    finally:
        stop.set()
        if not task.done():
            task.cancel()

"""Dead letters return credit to the feeder (a dead-lettered group is replaced). A forged letter must not
raise the release budget: only groups the feeder released itself earn credit, each once."""

from __future__ import annotations

import pytest

from schemas import DeadLetter, encode
from tests import factories as f
from tests.waiting import until
from workers.roles.dead_credit import DeadLetterCredit

pytestmark = pytest.mark.bus


def released_id(index: int) -> str:
    """The id the feeder gave release `index` (the factory's naming)."""
    return f"g{index}"


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
        for seq, prompt in enumerate(letters, start=1):
            letter = DeadLetter(run=bus.run, reason="forged?", source_subject="x", stream_seq=100 + seq,
                                payload=encode(prompt))  # fmt: skip
            await bus.publish("dlq", letter)
        await until(lambda: len(credit.seen), lambda n: n >= 3, 10, "the letters to be read")
        assert credit.credit(10, released_id) == 1
        assert credit.credit(3, released_id) == 0, "index 3 is not released yet at a cursor of 3"
        assert credit.credit(1000, released_id) == 2, "once released, 999 is one of the feeder's groups"
    finally:
        await credit.stop()

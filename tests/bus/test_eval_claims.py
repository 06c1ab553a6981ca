"""The held-out evaluation's claims on the run state: of several rollout workers, exactly one evaluates each block
of `eval.every` versions, and a block is never evaluated after a later one was claimed."""

from __future__ import annotations

import asyncio

import pytest

from workers.roles.evaluation import claim_block
from workers.state_keys import EVAL_CLAIMED

pytestmark = pytest.mark.bus


async def test_exactly_one_worker_claims_each_block(bus, make_bus):
    workers = [bus, *[await make_bus(bus.config) for _ in range(3)]]  # four connections to the same run
    for block in range(5):
        results = await asyncio.gather(*(claim_block(w.run_state, block) for w in workers))
        assert sum(won for won, _ in results) == 1, results
        assert all(seen == block for _, seen in results), results
    assert (await bus.run_state.count(EVAL_CLAIMED))[0] == 5  # blocks 0-4 claimed


async def test_a_block_behind_the_claims_is_never_claimed(bus):
    assert await claim_block(bus.run_state, 3) == (True, 3)  # a worker that loaded v30 first (every=10)
    assert await claim_block(bus.run_state, 1) == (False, 3)  # one still at v15: block 1 is passed over
    assert await claim_block(bus.run_state, 3) == (False, 3)  # a crashed owner's block is not done again
    assert await claim_block(bus.run_state, 4) == (True, 4)

"""A whole run with deltas against v0 and the bfloat16 wire: every role a process, a real nats-server; the
rollout and reference roles rebuild every version they load."""

from __future__ import annotations

import uuid

import pytest

from schemas import WeightsAnnouncement
from tests.e2e.cluster import small_config
from tests.e2e.test_pipeline import run
from workers.config import parse_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


async def test_a_run_on_bfloat16_deltas_trains_every_group_once(nats_server, tmp_path):
    config = parse_config(
        small_config(
            f"wire{uuid.uuid4().hex[:8]}",
            weights={"type": "object_store", "delta": True, "wire_dtype": "bfloat16"},
            trainer={"kl": {"coef": 0.01}},  # the reference reads v0, which stays whole and exact
        )
    )
    cluster = await run(nats_server, tmp_path, config)
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        sizes = {e.version: e.size for e in await cluster.read("events") if isinstance(e, WeightsAnnouncement)}
        assert sorted(sizes) == list(range(config.trainer.steps + 1))
        # every later version is half of v0 or less (float32 as bfloat16; all tensors train here, none stays behind)
        assert all(size < 0.55 * sizes[0] for v, size in sizes.items() if v > 0), sizes
    finally:
        await cluster.stop()

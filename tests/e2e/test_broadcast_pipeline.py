"""A whole run whose weights reach the rollout workers by gloo broadcast (the trainer's rank 0 to every worker that
joined), the object store serving the reference role, first fetches and missed rounds. Its rollout worker is
SIGKILLed mid-run and a new one joins: the newcomer reads the current version from the store, joins, and gets every
later version by broadcast; every group is trained exactly once."""

from __future__ import annotations

import uuid

import pytest

from tests.e2e.cluster import Cluster, replace_the_rollout_worker, role_events, small_config
from workers.config import parse_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


async def test_a_run_with_broadcast_weights_trains_every_group_once_and_a_joiner_gets_broadcasts(nats_server, tmp_path):
    config = parse_config(
        small_config(
            f"e2e{uuid.uuid4().hex[:8]}",
            weights={"type": "broadcast", "timeout_s": 5},
            trainer={"steps": 14, "kl": {"coef": 0.1}},  # the joiner needs versions after the one it joins at
        )
    )
    cluster = await Cluster.start(nats_server.url, config, tmp_path)
    try:
        joiner, loaded = await replace_the_rollout_worker(cluster)
        await cluster.wait_done()
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        received = [e["version"] for e in role_events(joiner, "weights_broadcast_received")]
        assert received and min(received) > loaded["version"], (received, loaded)
        new_id = role_events(joiner, "worker_started")[0]["worker"]
        versions = {g.policy_version for g in acc.train_groups if g.scored.rollout.worker_id == new_id}
        assert versions & set(received), (versions, received)  # it generated with weights it was broadcast
        rounds = role_events(cluster.role("actor"), "weights_broadcast")
        assert rounds and max(r["members"] for r in rounds) >= 1, rounds
    finally:
        await cluster.stop()

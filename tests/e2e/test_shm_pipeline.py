"""A whole run whose weights travel through shared memory: every role a process on this host, the
reference role reads v0 and the rollout workers the newer versions from the trainer's segments. Its
rollout worker is SIGKILLed mid-run and a new one joins: the newcomer maps the current version, not v0."""

from __future__ import annotations

import uuid

import pytest

from tests.e2e.cluster import Cluster, replace_the_rollout_worker, role_events, small_config
from workers.config import parse_config
from workers.weights import SharedMemoryTransport

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


async def test_a_run_with_shm_weights_trains_every_group_once_and_prunes_its_segments(nats_server, tmp_path):
    config = parse_config(
        small_config(
            f"e2e{uuid.uuid4().hex[:8]}",
            weights={"type": "shm"},
            trainer={"steps": 24, "kl": {"coef": 0.1}},  # a tiny step takes ~0.05 s: the joiner must still be needed
            bus={"weights_keep": 2},
        )
    )
    segments = SharedMemoryTransport(config.run, config.bus.weights_keep)
    cluster = await Cluster.start(nats_server.url, config, tmp_path)
    try:
        joiner, loaded = await replace_the_rollout_worker(cluster)
        await cluster.wait_done()
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        assert max(g.policy_version for g in acc.train_groups) > 0  # rollouts loaded published versions
        new_id = role_events(joiner, "worker_started")[0]["worker"]
        joined = [g.policy_version for g in acc.train_groups if g.scored.rollout.worker_id == new_id]
        assert joined and min(joined) >= loaded["version"], (joined, loaded)
        names = sorted(p.name for p in segments.dir.iterdir())
        assert names == ["v0.safetensors", "v23.safetensors", "v24.safetensors"], names
    finally:
        await cluster.stop()
        segments.remove_run()
    assert not segments.dir.exists()

"""A whole run whose weights travel through shared memory: every role a process on this host, the
reference role reads v0 and the rollout workers the newer versions from the trainer's segments. Its
rollout worker is SIGKILLed mid-run and a new one joins: the newcomer maps the current version, not v0."""

from __future__ import annotations

import uuid

import pytest

from tests.e2e.cluster import Cluster, role_events, small_config
from tests.waiting import until
from workers.config import parse_config
from workers.launch.processes import RoleProcess
from workers.weights import SharedMemoryTransport

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


async def test_a_run_with_shm_weights_trains_every_group_once_and_prunes_its_segments(nats_server, tmp_path):
    config = parse_config(
        small_config(
            f"e2e{uuid.uuid4().hex[:8]}",
            weights={"type": "shm"},
            trainer={"steps": 8, "kl_coef": 0.1},
            bus={"weights_keep": 2},
        )
    )
    segments = SharedMemoryTransport(config.run, config.bus.weights_keep)
    cluster = await Cluster.start(nats_server.url, config, tmp_path)
    first = cluster.role("rollout")
    joiner = RoleProcess("rollout", 1, first.command, first.log_path.with_name("rollout-1.log"))
    try:
        await cluster.wait_step(3)
        cluster.kill("rollout")  # the run has no rollout worker until the new one joins
        assert cluster.bus is not None
        current, _ = await cluster.bus.version.get()
        joiner.start()
        loaded = await until(lambda: role_events(joiner, "weights_loaded"), bool, 120, "the new worker's first load")
        assert loaded[0]["version"] >= max(current, 1), f"joined at v{current}, first loaded {loaded}"
        await cluster.wait_done()
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        assert max(g.policy_version for g in acc.train_groups) > 0  # rollouts loaded published versions
        new_id = role_events(joiner, "worker_started")[0]["worker"]
        joined = [g.policy_version for g in acc.train_groups if g.scored.rollout.worker_id == new_id]
        assert joined and min(joined) >= loaded[0]["version"], (joined, loaded)
        names = sorted(p.name for p in segments.dir.iterdir())
        assert names == ["v0.safetensors", "v7.safetensors", "v8.safetensors"], names
    finally:
        joiner.stop()
        await cluster.stop()
        segments.remove_run()
    assert not segments.dir.exists()

"""A three-server JetStream cluster (replicas 3): SIGKILL the train stream's leader mid-run.

Publishers ride through the election (retrying under the same message ids), the roles reconnect to
the surviving servers, and the accounting still holds: nothing lost, nothing trained twice.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.chaos.report import REPORTS, ChaosReport, figures
from tests.chaos.test_chaos import wait_unstuck
from tests.e2e.cluster import Cluster, small_config
from tests.e2e.test_pipeline import run_id
from workers.config import parse_config

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

STEPS = 12


async def test_killing_the_stream_leader_mid_run_loses_nothing(nats_cluster, tmp_path):
    config = parse_config(
        small_config(
            run_id(), trainer={"steps": STEPS, "checkpoint": {"every": 2}}, bus={"replicas": 3, "ack_wait_s": 3}
        )
    )
    cluster = await Cluster.start(nats_cluster.url, config, tmp_path)
    try:
        assert cluster.bus is not None
        train = cluster.bus.topology.stream("train").name
        info = await cluster.bus.js.stream_info(train)
        assert info.config.num_replicas == 3 and info.cluster is not None
        await cluster.wait_step(4)
        leader = (await cluster.bus.js.stream_info(train)).cluster.leader
        nats_cluster.servers[leader].kill()
        await cluster.wait_done(timeout_s=300)
        acc = await cluster.accounting()
        acc.check_exactly_once(STEPS, config.groups_per_step)
        after = (await cluster.bus.js.stream_info(train)).cluster
        assert after.leader != leader, "a new leader took over"
        stuck = await wait_unstuck(cluster, 4 * config.bus.ack_wait_s + 10)
        version = await cluster.kv_int("policy.version")
        values = figures(acc, STEPS, version, sum(p + u for p, u in stuck.values()))
        log = [f"step 4: SIGKILL {leader} (leader of {train}); new leader {after.leader}"]
        REPORTS.append(ChaosReport("3-server R3 cluster", Counter({f"leader {leader}": 1}), Counter(), values, log))
        assert values["duplicated"] == 0 and values["lost"] == 0, values
        assert not stuck, f"messages left pending/unacked: {stuck}"
    finally:
        await cluster.stop()

"""Chaos: SIGKILL each role in turn, or the nats-server itself, during a real run; nothing is lost
and nothing is trained twice. The kill plan comes from a seed (RELAX_CHAOS_SEED, default 7), and
each run's accounting is printed as a table at the end of the test session."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from relax_bus.ops.server import EmbeddedServer
from tests.chaos.driver import SERVER, Chaos, Kill, plan
from tests.chaos.report import REPORTS, ChaosReport, figures
from tests.e2e.cluster import Cluster, small_config
from tests.e2e.test_pipeline import run_id
from workers.config import PipelineConfig, parse_config

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

SEED = int(os.environ.get("RELAX_CHAOS_SEED", "7"))
STEPS = 16


def chaos_config() -> PipelineConfig:
    return parse_config(
        small_config(
            run_id(),
            trainer={"steps": STEPS, "checkpoint": {"every": 2}, "kl": {"coef": 0.02}},
            bus={"ack_wait_s": 3, "max_deliver": 10},
        )
    )


async def run_chaos(name: str, server: EmbeddedServer, tmp_path, kills: list[Kill], with_server: bool) -> None:
    config = chaos_config()
    assert config.reference, "the chaos run must have every role, the reference included"
    cluster = await Cluster.start(server.url, config, tmp_path)
    chaos = Chaos(cluster, server if with_server else None)
    try:
        await chaos.run(kills)
        assert sum(chaos.kills.values()) == len(kills), chaos.log
        await cluster.wait_done()
        acc = await cluster.accounting()
        acc.check_exactly_once(STEPS, config.groups_per_step)
        stuck = await wait_unstuck(cluster, 4 * config.bus.ack_wait_s + 60)
        version = await cluster.kv_int("policy.version")
        # The trainer's records agree: the surviving record of each step carries a strictly
        # increasing version, the last of which is the published policy version.
        last = {int(m.step): int(m.values["version"]) for m in acc.metrics}
        versions = [last[s] for s in range(1, STEPS + 1)]
        assert versions == sorted(set(versions)), versions
        assert versions[-1] == version
        assert await cluster.kv_int("trainer.step") == STEPS
        dlq = await cluster.read("dlq")
        assert not dlq, f"dead-lettered during the run: {dlq}"
        values = figures(acc, STEPS, version, sum(p + u for p, u in stuck.values()))
        REPORTS.append(ChaosReport(name, chaos.kills, chaos.unplanned, values, chaos.log))
        assert values["duplicated"] == 0 and values["lost"] == 0, values
        assert not stuck, f"messages left pending/unacked: {stuck}"
    finally:
        if with_server and server.proc is None:
            server.start()
        await cluster.stop()


async def wait_unstuck(cluster: Cluster, timeout_s: float) -> dict[str, tuple[int, int]]:
    """Redeliveries of work done just before a kill settle within a few ack waits."""
    deadline = time.monotonic() + timeout_s
    while (stuck := await cluster.stuck()) and time.monotonic() < deadline:  # noqa: ASYNC110 - polls the server
        await asyncio.sleep(0.5)
    return stuck


async def test_sigkill_of_each_role_in_turn_loses_nothing(nats_server, tmp_path):
    targets = [("feeder", 0), ("rollout", 0), ("reward", 0), ("reference", 0), ("actor", 0)]
    kills = plan(SEED, targets, STEPS)
    await run_chaos(f"roles (seed {SEED})", nats_server, tmp_path, kills, with_server=False)


async def test_sigkill_of_the_nats_server_loses_nothing(nats_server, tmp_path):
    kills = plan(SEED + 1, [(SERVER, 0), (SERVER, 1)], STEPS)
    await run_chaos(f"nats-server (seed {SEED + 1})", nats_server, tmp_path, kills, with_server=True)

"""Soak: several rollout and reward workers, a small max_ack_pending, a few minutes of steady work.

Memory of every role stays flat and every hop stays within what the credit rule lets into the
pipeline. RELAX_SOAK_S sets the duration (default 90 s); the table is printed at the end of the session.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tests.chaos.report import SOAK_TABLES
from tests.chaos.soak import Samples
from tests.e2e.cluster import Cluster, small_config
from tests.e2e.test_pipeline import run_id
from workers.config import parse_config

SOAK_S = float(os.environ.get("RELAX_SOAK_S", "90"))
MIN_STEPS = 10  # the soak goes on past SOAK_S until this many steps are trained
STEPS_GRACE_S = 240.0
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(int(SOAK_S + STEPS_GRACE_S) + 300)]


async def test_soak_keeps_memory_and_queues_bounded(nats_server, tmp_path):
    staleness, per_step = 2, 4
    config = parse_config(
        small_config(
            run_id(),
            groups_per_step=per_step,
            staleness={"max_staleness": staleness},
            roles={"rollout": 3, "reward": 2},
            trainer={"steps": 100_000, "checkpoint": {"every": 20}},
            bus={"max_ack_pending": per_step},  # the least a step needs: the actor holds one
        )
    )
    cluster = await Cluster.start(nats_server.url, config, tmp_path)
    samples = Samples()
    try:
        await cluster.wait_step(1)
        started = time.monotonic()
        first_step = await cluster.kv_int("trainer.step")
        steps = 0
        # At least SOAK_S of steady work and at least MIN_STEPS steps: a loaded machine soaks for longer.
        while time.monotonic() - started < SOAK_S or steps < MIN_STEPS:
            assert time.monotonic() - started < SOAK_S + STEPS_GRACE_S, (
                f"only {steps} steps in {time.monotonic() - started:.0f}s\n{cluster.all_logs()}"
            )
            for r in cluster.roles:
                assert r.proc is not None and r.proc.poll() is None, f"{r.name}-{r.index} died:\n{cluster.log_tail(r)}"
            await samples.take(cluster)
            steps = await cluster.kv_int("trainer.step") - first_step
            await asyncio.sleep(0.5)  # sampling interval of the memory and queue series
        soaked_s = time.monotonic() - started
    finally:
        await cluster.stop()
    SOAK_TABLES.append(
        samples.table(
            f"soak: {soaked_s:.0f}s, {steps} steps, rollout x3, reward x2, max_ack_pending 4, max_staleness 2"
        ),
    )
    # The credit rule admits at most (S + 1) * B groups beyond the trained ones: no hop can hold more.
    bound = (staleness + 1) * per_step
    for hop, series in samples.depth.items():
        assert max(series) <= bound, (hop, max(series), bound)
    for name in samples.rss:
        early, late = samples.growth(name)
        assert late <= early * 1.25 + 40, f"{name} grew from {early:.0f} to {late:.0f} MiB"

"""Dynamic sampling in whole runs: three groups in four are uniform, the reward role filters them, the feeder
over-samples, and the run still trains every step with `groups_per_step` informative groups, each released
group settled exactly once (trained, dropped as stale, or filtered)."""

from __future__ import annotations

import uuid

import pytest

from relax_bus.staleness import release_budget
from schemas import RunEvent
from tests.e2e.cluster import Cluster, small_config
from tests.e2e.sampling_rewards import informative
from workers.config import parse_config, task_seed, task_spec
from workers.data.tasks import load_task
from workers.roles.feeder import released_item
from workers.roles.filtered_credit import count_below, is_uniform, read_filtered

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REWARD = {"type": "python", "options": {"function": "tests.e2e.sampling_rewards:mostly_constant"}}


@pytest.mark.parametrize("max_staleness", [0, 1])
async def test_most_groups_uniform_the_run_still_trains_every_step(nats_server, tmp_path, max_staleness):
    config = parse_config(
        small_config(
            f"e2e{uuid.uuid4().hex[:8]}",
            staleness={"max_staleness": max_staleness},
            trainer={"steps": 3, "optim": {"lr": 1e-3}, "checkpoint": {"every": 2}, "warmup": {"max_steps": 0}},
            rewards=[REWARD],
            sampling={"drop_uniform": True, "max_oversample": 8.0},
        )
    )
    cluster = await Cluster.start(nats_server.url, config, tmp_path)
    try:
        await cluster.wait_done(timeout_s=200)
        acc = await cluster.accounting()
        steps, b = config.trainer.steps, config.groups_per_step
        acc.check_exactly_once(steps, b)  # filtered groups count as settled, never as trained

        # Every release is accounted for exactly once, and the feeder's credit is the filtered set in KV.
        assert acc.released == len(acc.trained) + len(set(acc.dropped)) + len(acc.filtered)
        assert cluster.bus is not None
        bitmap, _ = await read_filtered(cluster.bus.state)
        assert count_below(bitmap, acc.released) == len(acc.filtered)
        # Exactly the prompts whose reward is constant were filtered, and most of the released groups were.
        items, seed = load_task(task_spec(config.task)), task_seed(config.task)
        answers = {gid: item.answer for gid, item in (released_item(items, i, seed) for i in range(acc.released))}
        assert sorted(acc.filtered) == sorted(g for g, a in answers.items() if not informative(a))
        assert len(acc.filtered) > acc.released / 2
        assert all(not is_uniform(g.scored.rewards) for g in acc.train_groups)
        # The over-sampled credit rule: every trained group was released inside its budget.
        credit = len(acc.filtered) + len(set(acc.dropped))
        for g in acc.train_groups:
            p = g.scored.rollout.prompt
            budget = release_budget(p.released_at_version, max_staleness, b, credit)
            assert budget is not None and p.release_index < budget
        # The filtered fraction reaches the events stream (and from there the metrics role).
        progress = [
            e for e in await cluster.read("events") if isinstance(e, RunEvent) and e.event == "sampling_progress"
        ]
        assert progress and progress[-1].fields["filtered"] == len(acc.filtered)
        assert progress[-1].fields["filtered_fraction"] == round(len(acc.filtered) / acc.released, 6)
    finally:
        await cluster.stop()

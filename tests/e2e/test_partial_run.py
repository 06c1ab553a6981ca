"""Partial rollouts in whole runs: every role a process, a real nats-server, versions switched between chunks.
Per token, the version a trained sample carries is checked against the step that trained it."""

from __future__ import annotations

import uuid

import pytest

from tests.e2e.cluster import small_config
from tests.e2e.test_pipeline import run
from workers.config import parse_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


# staleness.mask_stale_tokens is exercised by tests/workers/test_partial_rollout.py: in these short runs no token
# falls more than two versions behind, so a masked case here would mask nothing.
@pytest.mark.parametrize("mode", ["continue", "restart"])
async def test_every_trained_token_carries_a_version_the_staleness_rule_allowed(nats_server, tmp_path, mode):
    staleness, mask = 2, mode.endswith("-masked")
    config = parse_config(
        small_config(
            f"partial{uuid.uuid4().hex[:8]}",
            staleness={"max_staleness": staleness, "mask_stale_tokens": mask},
            rollout={"max_new_tokens": 6, "batch_groups": 4, "partial": mode.split("-")[0], "partial_chunk": 1},
            trainer={"steps": 10},
        )
    )
    cluster = await run(nats_server, tmp_path, config)
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        step_of = {g: step for step, ids in acc.effective.items() for g in ids}
        trained = {g.group_id: g for g in acc.train_groups if g.group_id in step_of}
        assert set(trained) == set(step_of)
        straddled = masked = 0
        for gid, group in trained.items():
            trainer_version = step_of[gid] - 1  # step s trains on version s - 1 and publishes s
            rollout = group.scored.rollout
            versions = []
            for s in rollout.samples:
                spans = s.version_spans or ((rollout.policy_version, s.token_ids.numel),)
                assert sum(n for _, n in spans) == s.token_ids.numel, (gid, spans)
                tokens = [v for v, n in spans for _ in range(n)]
                assert all(v <= trainer_version for v in tokens), (gid, spans, trainer_version)
                straddled += len(spans) > 1
                versions += tokens
            # the group's version is its oldest token's; the rule judges by it (by the newest with the mask, the
            # older tokens then left out of the loss, counted by the trainer)
            assert rollout.policy_version == min(versions), (gid, rollout.policy_version, min(versions))
            judged = max(versions) if mask else min(versions)
            assert trainer_version - judged <= staleness, (gid, trainer_version, versions)
            masked += sum(v < trainer_version - staleness for v in versions)
        recorded = sum(m.values.get("masked_stale_tokens", 0.0) for m in acc.metrics)
        assert recorded == (masked if mask else 0), (recorded, masked)
        print(f"{mode}: {straddled} trained samples straddle a version boundary, {masked} tokens masked")
    finally:
        await cluster.stop()

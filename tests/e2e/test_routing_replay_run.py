"""R3 in whole runs: tiny-moe, every role a process, the rollout's routing replayed by the trainer and the
reference, a rollout worker SIGKILLed mid-run. Assertions come from the streams, KV and the step records."""

from __future__ import annotations

import uuid

import pytest

from tests.e2e.cluster import kill_after_step, small_config
from tests.e2e.test_pipeline import run
from workers.config import parse_config
from workers.training.batch import routed_experts

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]
ROUTING_METRICS = ("routing_agreement", "routing_mismatch_replay", "routing_mismatch_free")


@pytest.mark.parametrize("staleness", [0, 2], ids=["on-policy", "max-staleness-2"])
async def test_r3_run_replays_the_rollouts_routing_through_a_rollout_crash(nats_server, tmp_path, staleness):
    config = parse_config(
        small_config(
            f"r3{uuid.uuid4().hex[:8]}",
            model={"source": "tiny-moe"},
            staleness={"max_staleness": staleness},
            roles={"rollout": 2},
            trainer={"steps": 8, "moe": {"routing_replay": "r3"}, "kl": {"coef": 0.01}},
        )
    )
    assert config.reference  # the reference role is in the chain and replays the routing too

    cluster = await run(nats_server, tmp_path, config, kill_after_step(2, "rollout"))
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        trained = set(acc.trained)
        groups = [g for g in acc.train_groups if g.group_id in trained]
        assert {g.group_id for g in groups} == trained
        for g in groups:
            prompt = g.scored.rollout.prompt_token_ids.numel
            assert g.ref_logprobs is not None
            for s in g.scored.rollout.samples:
                routes = routed_experts(s.routed_experts)
                assert routes is not None, f"group {g.group_id}: a trained sample without routing"
                assert tuple(routes.shape) == (prompt + s.token_ids.numel - 1, 2, 2)
                assert int(routes.max()) < 8
        steps = {m.step: m.values for m in acc.metrics}
        assert sorted(steps) == list(range(1, config.trainer.steps + 1))
        for step, values in steps.items():
            missing = [k for k in ROUTING_METRICS if k not in values]
            assert not missing, f"step {step} has no {missing}"
        if staleness == 0:  # the trainer holds the very weights that generated each group
            worst = max(v["routing_mismatch_replay_max"] for v in steps.values())
            assert worst < 1e-3, worst
            assert all(v["routing_agreement"] == 1.0 for v in steps.values())
    finally:
        await cluster.stop()

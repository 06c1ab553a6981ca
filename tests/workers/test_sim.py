"""The simulated engine and trainer of the cluster benchmarks (timing, valid outputs); when the actor reads ahead."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from schemas import PromptGroup, RolloutGroup, Sample, ScoredGroup, TextPart, TrainGroup, WireTensor
from workers.config import parse_config
from workers.data.tokenizer import EOS_ID
from workers.engines.base import SamplingSettings, make_engine
from workers.engines.sim_engine import SimEngine, call_seconds
from workers.training.devices import reads_ahead
from workers.training.sim_trainer import SimulatedTrainer

pytestmark = pytest.mark.workers


def test_a_call_takes_the_longest_of_its_groups() -> None:
    assert call_seconds(random.Random(0), 5, 0.1, 0.0) == pytest.approx(0.1)
    assert call_seconds(random.Random(0), 0, 0.1, 1.0) == 0.0
    assert call_seconds(random.Random(0), 3, 0.0, 1.0) == 0.0
    one = [call_seconds(random.Random(s), 1, 0.1, 1.0) for s in range(200)]
    many = [call_seconds(random.Random(s), 16, 0.1, 1.0) for s in range(200)]
    assert sum(many) / len(many) > 3 * sum(one) / len(one)  # the long tail of 16 groups


def test_sim_engine_is_registered_and_returns_valid_samples(tmp_path: Path) -> None:
    engine = make_engine("sim", tmp_path, group_median_s=0.01, load_s=0.0, seed=1)
    assert isinstance(engine, SimEngine) and engine.max_context is None
    started = time.perf_counter()
    out = engine.generate([[257, 51], [257, 52, 53]], 3, SamplingSettings(max_new_tokens=4))
    assert time.perf_counter() - started >= 0.009
    assert [len(samples) for samples in out] == [3, 3]
    for g in (g for samples in out for g in samples):
        assert len(g.token_ids) == len(g.logprobs) <= 4 and all(lp < 0 for lp in g.logprobs)
        assert g.finish_reason == "stop" and g.token_ids[-1] == EOS_ID and g.text.isdigit()
    assert engine.tokens_generated() == sum(len(g.token_ids) for samples in out for g in samples)
    engine.load_state_dict({"w": torch.zeros(1)}, 7)
    assert engine.version == 7 and engine.loads == 1


def test_simulated_trainer_sleeps_and_reports_the_batch_rewards(tmp_path: Path) -> None:
    from workers.data.models import materialize

    model_dir = materialize("tiny:64x2", tmp_path / "m", seed=0)
    config = parse_config({"run": "sim", "trainer": {"simulate": {"step_s": 0.02}}})
    trainer = SimulatedTrainer(model_dir, config)
    before = {k: v.clone() for k, v in trainer.full_state().items()}
    prompt = PromptGroup(
        run="sim", group_id="g", parts=(TextPart(text="1+1="),), n_samples=2, release_index=0, released_at_version=0
    )
    sample = Sample(
        token_ids=WireTensor.from_values([50, EOS_ID], "int32"),
        logprobs=WireTensor.from_values([-1.0, -1.0], "float32"),
    )
    rollout = RolloutGroup(
        prompt=prompt,
        prompt_token_ids=WireTensor.from_values([257], "int32"),
        samples=(sample, sample),
        policy_version=0,
    )
    group = TrainGroup(scored=ScoredGroup(rollout=rollout, rewards=(1.0, 0.0)))
    metrics = trainer.step([group])
    assert metrics["train_s"] >= 0.02 and metrics["reward_mean"] == 0.5 and metrics["response_tokens"] == 4
    assert all(torch.equal(before[k], v) for k, v in trainer.full_state().items())


def test_sim_engine_per_prompt_seeds_are_independent_of_the_batch(tmp_path: Path) -> None:
    engine = make_engine("sim", tmp_path)
    settings = SamplingSettings(max_new_tokens=4)
    together = engine.generate([[257, 51], [257, 52]], 3, settings, seeds=[5, 9])
    assert engine.generate([[257, 52]], 3, settings, seeds=[9])[0] == together[1]


def test_the_actor_reads_ahead_unless_its_update_computes_on_the_cpu() -> None:
    def trainer(**options: object) -> object:
        return parse_config({"run": "ahead", "trainer": options}).trainer

    assert not reads_ahead(trainer(compute={"device": "cpu"}))  # decoding beside training would take its cores
    assert reads_ahead(trainer(compute={"device": "cpu"}, simulate={"step_s": 0.02}))  # a simulated update sleeps
    assert reads_ahead(trainer(compute={"device": "cpu", "read_ahead": "on"}))
    assert not reads_ahead(trainer(compute={"device": "cpu", "read_ahead": "off"}, simulate={"step_s": 0.02}))

"""One trainer step with every loss, correction and shaping option (tiny model, CPU), and their config models."""

from __future__ import annotations

import math

import pytest
import torch

from relax_bus.settings import ConfigError
from schemas import TrainGroup, WireTensor
from tests.workers.test_trainer import engine_groups
from workers.config import parse_config
from workers.data.models import materialize
from workers.engines.torch_engine import TorchEngine
from workers.training.advantages import overlong_penalty
from workers.training.corrections import CORRECTIONS
from workers.training.policy_losses import POLICY_LOSSES
from workers.training.trainer import PolicyTrainer

pytestmark = pytest.mark.workers


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = materialize("tiny:64x2", tmp_path_factory.mktemp("m") / "m", seed=5)
    groups = [_off_policy(g) for g in engine_groups(TorchEngine(model_dir), ["1+2=", "3+4="], n=4)]
    return model_dir, groups


def _off_policy(group: TrainGroup) -> TrainGroup:
    """The group as if a different policy had sampled it: its log-probs moved by -1.5, 0, +1.5 in turn."""
    rollout = group.scored.rollout
    samples = []
    for s in rollout.samples:
        shifted = [lp + 1.5 * ((k % 3) - 1) for k, lp in enumerate(s.logprobs.to_values())]
        samples.append(s.model_copy(update={"logprobs": WireTensor.from_values(shifted, "float32")}))
    scored = group.scored.model_copy(update={"rollout": rollout.model_copy(update={"samples": tuple(samples)})})
    return group.model_copy(update={"scored": scored})


def make_trainer(model_dir, **options) -> PolicyTrainer:
    config = parse_config(
        {
            "run": "alg",
            "groups_per_step": 2,
            "samples_per_group": 4,
            "rollout": {"temperature": 0.8, "max_new_tokens": 5},
            "trainer": {"optim": {"lr": 1e-2}, "mini_batches": 2, **options},
        }
    )
    return PolicyTrainer(model_dir, config)


def moved(trainer: PolicyTrainer, groups: list[TrainGroup]) -> tuple[dict[str, float], float]:
    """The step's metrics and the largest change of any weight."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.step(groups)
    change = max(float((p.detach() - before[n]).abs().max()) for n, p in trainer.model.named_parameters())
    return metrics, change


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
def test_a_step_runs_with_every_loss(setup, loss):
    model_dir, groups = setup
    metrics, change = moved(make_trainer(model_dir, loss=loss), groups)
    assert metrics["updates"] == 2
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert change > 0
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-6)  # later updates see a moved ratio


@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
def test_a_step_runs_with_every_correction(setup, correction):
    model_dir, groups = setup
    # seq_is: the shifts average out over a sequence, so its geometric mean stays near 1: a tight range
    bounds = {"low": 0.9, "high": 1.1} if correction == "seq_is" else {"low": 0.5, "high": 2.0}
    options = {"type": correction, **bounds} if correction != "none" else correction
    metrics, change = moved(make_trainer(model_dir, correction=options), groups)
    assert change > 0 and all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["logprob_mismatch"] > 0.5  # the shifted log-probs: |1.5| on two tokens in three
    if correction == "none":
        assert metrics["tis_mean"] == 1.0 and metrics["tis_max"] == 1.0
    else:
        assert metrics["tis_clip_frac"] > 0 and 0 < metrics["tis_max"] <= bounds["high"] + 1e-6
    assert (metrics["tis_masked_frac"] > 0) == (correction == "icepop")


def test_overlong_shaping_moves_the_rewards_by_the_penalty(setup):
    model_dir, groups = setup
    shaping = {"max_tokens": 5, "window": 3, "penalty": 0.5}
    lengths = [[s.token_ids.numel for s in g.scored.rollout.samples] for g in groups]
    expected = overlong_penalty(torch.tensor(lengths), **shaping)
    assert float(expected.min()) < 0, lengths  # a response reaches the window
    metrics, _ = moved(make_trainer(model_dir, overlong=shaping, advantage={"type": "rloo", "whiten": True}), groups)
    assert metrics["overlong_penalty_mean"] == pytest.approx(float(expected.mean()), abs=1e-9)
    assert metrics["overlong_frac"] == pytest.approx(float((expected < 0).float().mean()))
    plain, _ = moved(make_trainer(model_dir), groups)
    assert "overlong_penalty_mean" not in plain and plain["reward_mean"] == metrics["reward_mean"]


# --------------------------------------------------------------------------------------------------
# config models


def trainer_config(**options):
    return parse_config({"run": "r", "trainer": options}).trainer


def test_defaults_are_ppo_with_icepop_and_the_tis_bounds_are_the_corrections():
    cfg = trainer_config()
    assert (cfg.loss.type, cfg.correction.type) == ("ppo", "icepop")
    assert cfg.correction_options() == {"low": 0.5, "high": 5.0}
    assert trainer_config(correction="tis").correction_options() == {"low": 0.0, "high": 2.0}
    with_bounds = trainer_config(correction={"type": "tis", "low": 0.1, "high": 3.0})
    assert with_bounds.correction.type == "tis"
    assert with_bounds.correction_options() == {"low": 0.1, "high": 3.0}
    assert trainer_config(correction={"type": "tis", "high": 4.0}).correction_options() == {"low": 0.0, "high": 4.0}
    assert trainer_config(correction="icepop").correction_options() == {"low": 0.5, "high": 5.0}
    assert trainer_config(loss={"type": "dual_clip", "c": 2.5}).loss.options() == {"c": 2.5}
    clipped = trainer_config(loss={"type": "gspo", "clip_low": 3e-4, "clip_high": 4e-4}).loss
    assert (clipped.clip_low, clipped.clip_high, clipped.options()) == (3e-4, 4e-4, {})


@pytest.mark.parametrize(
    "options",
    [
        {"correction": {"type": "tis", "high": 4.0}},
        {"correction": {"type": "seq_is", "low": 0.2, "high": 1.5}, "loss": "gspo"},
        {"correction": {"type": "tis", "low": 0.3, "high": 1.5}},
        {"advantage": {"type": "reinforce_pp", "whiten": True}, "overlong": {"max_tokens": 8, "window": 2}},
    ],
)
def test_a_dumped_config_validates_again_unchanged(options):
    config = parse_config({"run": "r", "trainer": options})
    again = parse_config(config.model_dump(mode="json"))
    assert again.trainer == config.trainer
    assert again.trainer.correction_options() == config.trainer.correction_options()


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"correction": {"type": "tis", "low": 3.0}}, r"low \(3.0\) must be below high \(2.0\)"),
        ({"loss": {"type": "ppo", "clip_low": 1.0}}, "trainer.loss.ppo.clip_low: Input should be less than 1"),
        ({"correction": {"type": "icepop", "low": 5.0, "high": 1.0}}, r"low \(5.0\) must be below high \(1.0\)"),
        ({"loss": {"type": "dual_clip", "c": 1.0}}, "trainer.loss.dual_clip.c: Input should be greater than 1"),
        ({"loss": {"type": "gspo", "c": 3.0}}, "trainer.loss.gspo.c: unknown setting"),
        ({"loss": "trpo"}, "trainer.loss: unknown type 'trpo'"),
        ({"overlong": {"max_tokens": 4, "window": 8}}, r"window \(8\) must not exceed max_tokens \(4\)"),
    ],
)
def test_config_mistakes_are_one_line_each(options, problem):
    with pytest.raises(ConfigError, match=problem):
        trainer_config(**options)

"""The actor trains only on what it can: one NaN reward or log-prob would reach every weight through the
optimizer, and an out-of-vocabulary id or a misaligned reference row would crash the step with its groups
stuck. Such a group is refused before it is held (`Reject`: dead-lettered, its credit back to the feeder)."""

from __future__ import annotations

import math

import pytest

from schemas import TrainGroup, WireTensor
from tests import factories as f
from workers.training.batch import untrainable

pytestmark = pytest.mark.unit
VOCAB = 259  # the byte tokenizer's: the factories' samples are bytes and eos (258)


def _with_sample(group: TrainGroup, **update) -> TrainGroup:
    rollout = group.scored.rollout
    samples = (rollout.samples[0].model_copy(update=update), *rollout.samples[1:])
    scored = group.scored.model_copy(update={"rollout": rollout.model_copy(update={"samples": samples})})
    return group.model_copy(update={"scored": scored})


def test_a_sound_group_passes():
    good = f.train("r")
    assert untrainable(good, VOCAB) is None
    ref = tuple(WireTensor.from_values([-0.3, -0.2], "float32") for _ in good.scored.rollout.samples)
    assert untrainable(good.model_copy(update={"ref_logprobs": ref}), VOCAB) is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_rewards_and_logprobs_must_be_finite(bad):
    group = f.train("r")
    rewards = (bad, *group.scored.rewards[1:])
    nan_reward = group.model_copy(update={"scored": group.scored.model_copy(update={"rewards": rewards})})
    assert "reward not finite" in (untrainable(nan_reward, VOCAB) or "")
    nan_logprob = _with_sample(group, logprobs=WireTensor.from_values([bad, -0.1], "float32"))
    assert "rollout log-prob not finite" in (untrainable(nan_logprob, VOCAB) or "")
    ref = (WireTensor.from_values([-0.1, bad], "float32"),) * len(group.scored.rollout.samples)
    assert "reference log-prob not finite" in (untrainable(group.model_copy(update={"ref_logprobs": ref}), VOCAB) or "")


def test_token_ids_must_be_inside_the_vocabulary():
    group = f.train("r")
    assert "outside the vocabulary" in (untrainable(group, 50) or ""), "sample ids 48+k reach past 50"
    negative = _with_sample(group, token_ids=WireTensor.from_values([-1, 2], "int32"))
    assert "sample 0: token id outside" in (untrainable(negative, VOCAB) or "")
    rollout = group.scored.rollout.model_copy(update={"prompt_token_ids": WireTensor.from_values([1, 500], "int32")})
    far = group.model_copy(update={"scored": group.scored.model_copy(update={"rollout": rollout})})
    assert "prompt token id outside" in (untrainable(far, VOCAB) or "")


def test_reference_rows_must_line_up_with_the_samples():
    group = f.train("r")
    n = len(group.scored.rollout.samples)
    short = (WireTensor.from_values([-0.1], "float32"),) * n
    assert "1 reference log-probs for 2 tokens" in (
        untrainable(group.model_copy(update={"ref_logprobs": short}), VOCAB) or ""
    )
    few = (WireTensor.from_values([-0.1, -0.2], "float32"),) * (n - 1)
    assert "reference log-prob rows" in (untrainable(group.model_copy(update={"ref_logprobs": few}), VOCAB) or "")


def test_a_sequence_longer_than_the_model_context_is_refused():
    group = f.train("r")  # prompt 3 + response 2 tokens
    assert untrainable(group, VOCAB, max_tokens=5) is None
    assert "sample 0: 3 prompt + 2 response tokens exceed the model's context of 4 positions" in (
        untrainable(group, VOCAB, max_tokens=4) or ""
    )

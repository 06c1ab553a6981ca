"""Advantage estimators, batch whitening and the overlong reward shaping against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from workers.training.advantages import (
    ADVANTAGE_ESTIMATORS,
    drgrpo_advantages,
    gae_rewards,
    group_advantages,
    grpo_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    whiten,
)

pytestmark = pytest.mark.workers


def t(rows: list[list[float]], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


# --------------------------------------------------------------------------------------------------
# grpo and drgrpo


def test_grpo_one_winner_in_four():
    # r = [1, 0, 0, 0]: mean = 0.25, deviations = [0.75, -0.25, -0.25, -0.25]
    # population variance = (0.5625 + 3 * 0.0625) / 4 = 0.75 / 4 = 0.1875, std = sqrt(0.1875) = 0.4330127
    # A = [0.75 / 0.4330127, -0.25 / 0.4330127] = [sqrt(3), -1/sqrt(3)] = [1.7320508, -0.5773503]
    rewards = t([[1.0, 0.0, 0.0, 0.0]])
    s3 = math.sqrt(3.0)
    exact = group_advantages(rewards, "grpo", eps=0.0)
    assert exact.tolist()[0] == pytest.approx([s3, -1 / s3, -1 / s3, -1 / s3], abs=1e-12)
    # with the default eps = 1e-6 the denominator is 0.4330127 + 1e-6
    std = math.sqrt(0.1875)
    default = group_advantages(rewards)
    assert default.tolist()[0] == pytest.approx([0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3, abs=1e-12)


def test_grpo_uses_population_std():
    # r = [2, 4]: mean 3, population std = sqrt((1 + 1) / 2) = 1 -> A = [-1, 1]
    # (the sample std would be sqrt(2) and give -0.7071, 0.7071)
    advantages = group_advantages(t([[2.0, 4.0]]), "grpo", eps=0.0)
    assert advantages.tolist() == [[-1.0, 1.0]]


def test_drgrpo_one_winner_in_four():
    # r - mean = [1 - 0.25, 0 - 0.25, ...] = [0.75, -0.25, -0.25, -0.25], no std division
    advantages = group_advantages(t([[1.0, 0.0, 0.0, 0.0]]), "drgrpo")
    assert advantages.tolist() == [[0.75, -0.25, -0.25, -0.25]]


@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.3, -7.25])
def test_all_equal_group_gives_exact_zeros(mode, value):
    # 0.3 * 3 / 3 is not exactly 0.3 in floating point; the group must still give exact zeros
    rewards = torch.full((1, 3), value, dtype=torch.float32)
    for eps in (0.0, 1e-6):
        advantages = group_advantages(rewards, mode, eps=eps)
        assert advantages.tolist() == [[0.0, 0.0, 0.0]]


@pytest.mark.parametrize("mode", ["grpo", "drgrpo"])
def test_groups_are_independent(mode):
    # group 0 is flat (zeros); group 1 = [1, 0, 0, 0] as above; group 2 = [0, 1] -> mean 0.5, std 0.5
    rewards = t([[0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0]])
    advantages = group_advantages(rewards, mode, eps=0.0)
    s3 = math.sqrt(3.0)
    if mode == "grpo":
        # group 2: deviations +-0.5, population std 0.5 -> +-1
        expected = [[0.0] * 4, [s3, -1 / s3, -1 / s3, -1 / s3], [-1.0, 1.0, -1.0, 1.0]]
    else:
        expected = [[0.0] * 4, [0.75, -0.25, -0.25, -0.25], [-0.5, 0.5, -0.5, 0.5]]
    for row, want in zip(advantages.tolist(), expected, strict=True):
        assert row == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo", "reinforce_pp_baseline"])
def test_single_sample_group_is_zero(mode):
    assert group_advantages(t([[3.0], [-1.0]]), mode).tolist() == [[0.0], [0.0]]


def test_integer_rewards_are_accepted():
    # [[1, 0]]: mean 0.5, std 0.5 -> [1, -1]
    advantages = group_advantages(torch.tensor([[1, 0]]), "grpo", eps=0.0)
    assert advantages.is_floating_point()
    assert advantages.tolist() == [[1.0, -1.0]]


def test_grpo_standardises_every_group():
    torch.manual_seed(0)
    rewards = torch.rand(64, 8, dtype=torch.float64)
    advantages = group_advantages(rewards, "grpo", eps=0.0)
    assert torch.allclose(advantages.mean(dim=1), torch.zeros(64, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(advantages.std(dim=1, unbiased=False), torch.ones(64, dtype=torch.float64), atol=1e-12)
    centred = group_advantages(rewards, "drgrpo")
    assert torch.allclose(centred, rewards - rewards.mean(dim=1, keepdim=True), atol=1e-12)


def test_registry_names_the_estimators():
    expected = {
        "grpo": grpo_advantages,
        "drgrpo": drgrpo_advantages,
        "rloo": rloo_advantages,
        "reinforce_pp": reinforce_pp_advantages,
        "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
        "gae": gae_rewards,
    }
    assert expected == ADVANTAGE_ESTIMATORS


def test_gae_passes_the_rewards_on_for_the_per_token_advantages():
    rewards = torch.tensor([[1, 0], [0, 0]])
    out = gae_rewards(rewards)
    assert out.dtype.is_floating_point and torch.equal(out, rewards.float())


def test_unknown_advantage_mode_lists_the_modes():
    with pytest.raises(ValueError, match=r"unknown advantage mode 'ppo'.*drgrpo.*grpo"):
        group_advantages(t([[1.0, 0.0]]), "ppo")


@pytest.mark.parametrize("shape", [(4,), (2, 2, 2)])
def test_rewards_must_be_groups_by_samples(shape):
    with pytest.raises(ValueError, match=r"\[groups, samples\]"):
        group_advantages(torch.zeros(shape))


# --------------------------------------------------------------------------------------------------
# rloo


def test_rloo_one_winner_in_four():
    # r = [1, 0, 0, 0]: the others' means are [0, 1/3, 1/3, 1/3]
    # A = [1 - 0, 0 - 1/3, 0 - 1/3, 0 - 1/3] = [1, -1/3, -1/3, -1/3]  (= 4/3 * [0.75, -0.25, ...])
    advantages = group_advantages(t([[1.0, 0.0, 0.0, 0.0]]), "rloo")
    assert advantages.tolist()[0] == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-12)


def test_rloo_pair_and_flat_group():
    # [2, 5]: 2 - 5 = -3, 5 - 2 = 3; the flat group [0.3, 0.3, 0.3] gives exact zeros
    assert group_advantages(t([[2.0, 5.0]]), "rloo").tolist() == [[-3.0, 3.0]]
    flat = group_advantages(torch.full((1, 3), 0.3), "rloo")
    assert flat.tolist() == [[0.0, 0.0, 0.0]]


# --------------------------------------------------------------------------------------------------
# reinforce++


def test_reinforce_pp_whitens_over_the_batch():
    # all 4 rewards [1, 0 | 1, 1]: mean_B 0.75, deviations [0.25, -0.75, 0.25, 0.25]
    # population var = (3 * 0.0625 + 0.5625) / 4 = 0.1875, std = sqrt(3) / 4 = 0.4330127
    # A = [0.25, -0.75, 0.25, 0.25] / 0.4330127 = [1/sqrt(3), -sqrt(3), 1/sqrt(3), 1/sqrt(3)]
    s3 = math.sqrt(3.0)
    advantages = group_advantages(t([[1.0, 0.0], [1.0, 1.0]]), "reinforce_pp", eps=0.0)
    assert advantages.reshape(-1).tolist() == pytest.approx([1 / s3, -s3, 1 / s3, 1 / s3], abs=1e-12)
    # the flat group [1, 1] is not zero: it is above the batch mean (no group baseline)


def test_reinforce_pp_baseline_centres_per_group_then_scales_over_the_batch():
    # groups [1, 0] and [3, 3] and [4, 0]: centred [0.5, -0.5 | 0, 0 | 2, -2], batch mean 0
    # population std over the 6 = sqrt((0.25 * 2 + 4 * 2) / 6) = sqrt(8.5 / 6) = 1.1902381
    std = math.sqrt(8.5 / 6)
    advantages = group_advantages(t([[1.0, 0.0], [3.0, 3.0], [4.0, 0.0]]), "reinforce_pp_baseline", eps=0.0)
    expected = [0.5 / std, -0.5 / std, 0.0, 0.0, 2 / std, -2 / std]
    assert advantages.reshape(-1).tolist() == pytest.approx(expected, abs=1e-12)
    assert advantages[1].tolist() == [0.0, 0.0]  # exact, not rounding


# --------------------------------------------------------------------------------------------------
# whitening


def test_whiten_on_hand_values():
    # [1, 2, 3, 6]: mean 3, deviations [-2, -1, 0, 3], var (4 + 1 + 0 + 9) / 4 = 3.5
    std = math.sqrt(3.5)
    assert whiten(t([[1.0, 2.0], [3.0, 6.0]]), eps=0.0).reshape(-1).tolist() == pytest.approx(
        [-2 / std, -1 / std, 0.0, 3 / std], abs=1e-12
    )


def test_whitened_drgrpo_keeps_flat_groups_at_exact_zero():
    # drgrpo: [0.75, -0.25, -0.25, -0.25 | 0 x 4]; batch mean 0, population std over 8 = sqrt(0.75 / 8)
    rewards = t([[1.0, 0.0, 0.0, 0.0], [0.3, 0.3, 0.3, 0.3]])
    std = math.sqrt(0.75 / 8)
    advantages = group_advantages(rewards, "drgrpo", eps=0.0, whitened=True)
    assert advantages[0].tolist() == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], abs=1e-12)
    assert advantages[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_whitening_gives_zero_mean_unit_std_without_flat_groups():
    torch.manual_seed(4)
    rewards = torch.rand(16, 4, dtype=torch.float64)
    for mode in ADVANTAGE_ESTIMATORS:
        advantages = group_advantages(rewards, mode, eps=0.0, whitened=True)
        assert float(advantages.mean()) == pytest.approx(0.0, abs=1e-12), mode
        assert float(advantages.std(unbiased=False)) == pytest.approx(1.0, abs=1e-12), mode


# --------------------------------------------------------------------------------------------------
# overlong shaping


def test_overlong_penalty_is_zero_then_linear_then_full():
    # max 10, window 4: free up to 6; 7 -> -1/4, 8 -> -2/4, 10 -> -1, 12 -> -1; times penalty 0.5
    lengths = torch.tensor([[3, 6, 7, 8], [9, 10, 12, 0]])
    shaped = overlong_penalty(lengths, max_tokens=10, window=4, penalty=0.5)
    assert shaped.tolist() == [[0.0, 0.0, -0.125, -0.25], [-0.375, -0.5, -0.5, 0.0]]


def test_overlong_window_must_fit():
    with pytest.raises(ValueError, match=r"overlong window \(5\) must be in 1..max_tokens \(4\)"):
        overlong_penalty(torch.zeros(1, 1), max_tokens=4, window=5)


# ---------------------------------------------------------------- samples without a reward


@pytest.mark.parametrize("mode", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("whitened", [False, True])
def test_an_invalid_sample_is_left_out_as_if_never_sampled(mode: str, whitened: bool) -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 7.0], [0.5, 0.0, 1.0, 1.0], [0.0, 0.0, 9.0, 1.0]])  # [3, 4]
    valid = torch.tensor([[True, True, True, False], [True, True, True, True], [True, True, False, True]])
    got = group_advantages(rewards, mode, whitened=whitened, valid=valid)
    assert (got[~valid] == 0).all()
    if mode in ("grpo", "drgrpo", "rloo") and not whitened:  # per group: the group without its invalid sample
        for g in range(3):
            alone = group_advantages(rewards[g, valid[g]].unsqueeze(0), mode)
            torch.testing.assert_close(got[g, valid[g]], alone.squeeze(0))
    # The invalid rewards (7 and 9 here) do not move any valid sample's advantage.
    changed = rewards.clone()
    changed[~valid] = -100.0
    torch.testing.assert_close(group_advantages(changed, mode, whitened=whitened, valid=valid), got)
    # ... while without the mask they do (the test can fail).
    assert not torch.allclose(
        group_advantages(changed, mode, whitened=whitened), group_advantages(rewards, mode, whitened=whitened)
    )


def test_all_valid_is_the_plain_estimator_and_none_valid_is_all_zero() -> None:
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    everything = torch.ones_like(rewards, dtype=torch.bool)
    torch.testing.assert_close(group_advantages(rewards, "grpo", valid=everything), group_advantages(rewards, "grpo"))
    assert (group_advantages(rewards, "grpo", valid=~everything) == 0).all()

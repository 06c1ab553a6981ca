"""Advantages, TIS weights, decoupled PPO loss and KL penalties against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from workers.advantages import (
    ADVANTAGE_ESTIMATORS,
    drgrpo_advantages,
    group_advantages,
    grpo_advantages,
)
from workers.losses import AGGREGATIONS, KL_ESTIMATORS, aggregate, kl_penalty, policy_loss, tis_weights

pytestmark = pytest.mark.workers

LOG = math.log


def t(rows: list[list[float]], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


# --------------------------------------------------------------------------------------------------
# advantages


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


@pytest.mark.parametrize("mode", ["grpo", "drgrpo"])
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


def test_single_sample_group_is_zero():
    assert group_advantages(t([[3.0], [-1.0]])).tolist() == [[0.0], [0.0]]


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
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "drgrpo"}
    assert ADVANTAGE_ESTIMATORS["grpo"] is grpo_advantages
    assert ADVANTAGE_ESTIMATORS["drgrpo"] is drgrpo_advantages


def test_unknown_advantage_mode_lists_the_modes():
    with pytest.raises(ValueError, match=r"unknown advantage mode 'ppo'.*drgrpo.*grpo"):
        group_advantages(t([[1.0, 0.0]]), "ppo")


@pytest.mark.parametrize("shape", [(4,), (2, 2, 2)])
def test_rewards_must_be_groups_by_samples(shape):
    with pytest.raises(ValueError, match=r"\[groups, samples\]"):
        group_advantages(torch.zeros(shape))


# --------------------------------------------------------------------------------------------------
# TIS weights


def test_tis_weights_clip_below_inside_above_and_mask():
    # raw = exp(logp_old - logp_rollout) = [0.25, 1.0, 1.5, 4.0 | 0.5, 2.0, 9.0(masked), 0.1(masked)]
    raw = t([[0.25, 1.0, 1.5, 4.0], [0.5, 2.0, 9.0, 0.1]])
    logp_rollout = torch.full_like(raw, LOG(0.5))
    logp_old = logp_rollout + raw.log()
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0]])
    # low = 0.5, high = 2: 0.25 -> 0.5 (below), 1.0 and 1.5 kept, 4.0 -> 2.0 (above);
    # 0.5 and 2.0 sit on the bounds and are kept; masked positions -> 0
    w = tis_weights(logp_old, logp_rollout, mask, low=0.5, high=2.0)
    assert w.tolist()[0] == pytest.approx([0.5, 1.0, 1.5, 2.0], abs=1e-12)
    assert w.tolist()[1] == pytest.approx([0.5, 2.0, 0.0, 0.0], abs=1e-12)
    # defaults low = 0, high = 2: nothing is raised from below
    w = tis_weights(logp_old, logp_rollout, mask)
    assert w.tolist()[0] == pytest.approx([0.25, 1.0, 1.5, 2.0], abs=1e-12)


def test_tis_weights_are_detached():
    logp_old = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    logp_rollout = torch.tensor([[-1.5, -1.0]], requires_grad=True)
    w = tis_weights(logp_old, logp_rollout, torch.ones(1, 2))
    assert not w.requires_grad


def test_tis_weights_ignore_garbage_on_padding():
    logp_old = t([[-1.0, float("nan")]])
    logp_rollout = t([[-1.0, float("-inf")]])
    assert tis_weights(logp_old, logp_rollout, t([[1, 0]])).tolist() == [[1.0, 0.0]]


def test_tis_bounds_must_be_ordered():
    with pytest.raises(ValueError, match="tis low"):
        tis_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), low=2.0, high=1.0)


# --------------------------------------------------------------------------------------------------
# PPO loss on a 2 x 3 example
#
# sequence 0: A = +1, ratios [1.5, 0.5, padding]    sequence 1: A = -2, ratios [1.2, 0.5, 1.5]
# clip range [1 - 0.2, 1 + 0.28] = [0.8, 1.28]; surrogate s = min(r A, clip(r) A); loss_t = -w s
#   (0,0) r 1.5, A +1: r A = 1.5,  clip A = 1.28          -> s = 1.28, clipped     loss -1.28
#   (0,1) r 0.5, A +1: r A = 0.5,  clip A = 0.8           -> s = 0.5,  unclipped   loss -0.5
#   (1,0) r 1.2, A -2: r A = -2.4, clip A = -2.4 (inside) -> s = -2.4, unclipped   loss  2.4
#   (1,1) r 0.5, A -2: r A = -1.0, clip A = 0.8 * -2 = -1.6 -> s = -1.6, clipped   loss  1.6
#   (1,2) r 1.5, A -2: r A = -3.0, clip A = 1.28 * -2 = -2.56 -> s = -3.0, unclipped loss 3.0

RATIOS = [[1.5, 0.5, 1.0], [1.2, 0.5, 1.5]]
MASK = [[1, 1, 0], [1, 1, 1]]
ADVANTAGES = [1.0, -2.0]


def example(tis_raw: list[list[float]] | None = None, garbage: float = 100.0):
    """logp_old = log 0.5 everywhere, logp = logp_old + log ratio; padding holds garbage."""
    logp_old = torch.full((2, 3), LOG(0.5), dtype=torch.float64)
    logp = (logp_old + t(RATIOS).log()).clone()
    logp[0, 2] = garbage
    logp.requires_grad_(True)
    raw = t(tis_raw) if tis_raw is not None else torch.ones(2, 3, dtype=torch.float64)
    logp_rollout = logp_old - raw.log()  # exp(logp_old - logp_rollout) = raw
    return logp, logp_old, logp_rollout, t([ADVANTAGES])[0], t(MASK)


def test_ppo_loss_token_aggregation_on_policy_rollout():
    logp, logp_old, logp_rollout, advantages, mask = example()
    loss, metrics = policy_loss(logp, logp_old, logp_rollout, advantages, mask)
    # token: (-1.28 - 0.5 + 2.4 + 1.6 + 3.0) / 5 = 5.22 / 5 = 1.044
    assert loss.item() == pytest.approx(1.044, abs=1e-12)
    assert metrics["ppo_clip_frac"] == pytest.approx(2 / 5)  # (0,0) and (1,1)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.2 + 0.5 + 1.5) / 5)  # 5.2 / 5 = 1.04
    assert metrics["tis_mean"] == pytest.approx(1.0)
    assert metrics["tis_clip_frac"] == 0.0
    assert metrics["logprob_mismatch"] == pytest.approx(0.0, abs=1e-12)


def test_ppo_loss_sequence_aggregation_on_policy_rollout():
    logp, logp_old, logp_rollout, advantages, mask = example()
    loss, _ = policy_loss(logp, logp_old, logp_rollout, advantages, mask, aggregation="sequence")
    # sequence 0: (-1.28 - 0.5) / 2 = -0.89; sequence 1: (2.4 + 1.6 + 3.0) / 3 = 7 / 3
    # mean: (-0.89 + 2.3333333) / 2 = 0.7216667
    assert loss.item() == pytest.approx((-0.89 + 7 / 3) / 2, abs=1e-12)


def test_ppo_loss_with_tis_weights():
    # raw TIS = [[0.5, 3.0, pad], [1.0, 0.25, 2.0]] -> w (low 0, high 2) = [[0.5, 2.0, 0], [1.0, 0.25, 2.0]]
    tis_raw = [[0.5, 3.0, 7.0], [1.0, 0.25, 2.0]]
    logp, logp_old, logp_rollout, advantages, mask = example(tis_raw)
    loss, metrics = policy_loss(logp, logp_old, logp_rollout, advantages, mask)
    # per token: -1.28 * 0.5 = -0.64, -0.5 * 2 = -1.0 | 2.4 * 1 = 2.4, 1.6 * 0.25 = 0.4, 3.0 * 2 = 6.0
    # token: (-0.64 - 1.0 + 2.4 + 0.4 + 6.0) / 5 = 7.16 / 5 = 1.432
    assert loss.item() == pytest.approx(1.432, abs=1e-12)
    assert metrics["tis_mean"] == pytest.approx((0.5 + 2.0 + 1.0 + 0.25 + 2.0) / 5)  # 5.75 / 5 = 1.15
    assert metrics["tis_clip_frac"] == pytest.approx(1 / 5)  # only 3.0 lies outside [0, 2]; 2.0 is on the bound
    # |log 0.5| + |log 3| + |log 1| + |log 0.25| + |log 2| = 0.6931 + 1.0986 + 0 + 1.3863 + 0.6931 = 3.8712 -> / 5
    mismatch = (LOG(2) + LOG(3) + 0.0 + LOG(4) + LOG(2)) / 5
    assert metrics["logprob_mismatch"] == pytest.approx(mismatch, abs=1e-12)
    assert metrics["ppo_clip_frac"] == pytest.approx(2 / 5)  # TIS does not change which tokens are clipped

    loss, _ = policy_loss(logp, logp_old, logp_rollout, advantages, mask, aggregation="sequence")
    # sequence 0: (-0.64 - 1.0) / 2 = -0.82; sequence 1: (2.4 + 0.4 + 6.0) / 3 = 8.8 / 3
    # mean: (-0.82 + 2.9333333) / 2 = 1.0566667
    assert loss.item() == pytest.approx((-0.82 + 8.8 / 3) / 2, abs=1e-12)


def test_tis_clip_frac_counts_both_sides():
    # raw [[0.1, 1.0, 5.0], [0.3, 0.6, 2.5]] with tis range [0.5, 2]: 0.1, 5.0, 0.3, 2.5 outside -> 4 / 6
    raw = t([[0.1, 1.0, 5.0], [0.3, 0.6, 2.5]])
    logp_old = torch.full((2, 3), -1.0, dtype=torch.float64)
    logp_rollout = logp_old - raw.log()
    _, metrics = policy_loss(
        logp_old.clone(), logp_old, logp_rollout, t([[1.0, 1.0]])[0], torch.ones(2, 3), tis_low=0.5, tis_high=2.0
    )
    assert metrics["tis_clip_frac"] == pytest.approx(4 / 6)
    # w = [0.5, 1.0, 2.0, 0.5, 0.6, 2.0] -> mean 6.6 / 6 = 1.1
    assert metrics["tis_mean"] == pytest.approx(1.1)


def test_ppo_gradient_is_zero_exactly_on_active_clips():
    logp, logp_old, logp_rollout, advantages, mask = example()
    loss, _ = policy_loss(logp, logp_old, logp_rollout, advantages, mask)
    loss.backward()
    # unclipped: d/dlogp of -(r A) / N = -A r / N with N = 5 valid tokens
    #   (0,1): -(+1)(0.5) / 5 = -0.1; (1,0): -(-2)(1.2) / 5 = 0.48; (1,2): -(-2)(1.5) / 5 = 0.6
    # clipped (0,0), (1,1) and padding (0,2): 0
    expected = [[0.0, -0.1, 0.0], [0.48, 0.0, 0.6]]
    for row, want in zip(logp.grad.tolist(), expected, strict=True):
        assert row == pytest.approx(want, abs=1e-12)
    assert logp.grad[0, 0] == 0.0 and logp.grad[1, 1] == 0.0 and logp.grad[0, 2] == 0.0


def test_ppo_gradient_is_scaled_by_tis_weight():
    logp, logp_old, logp_rollout, advantages, mask = example([[0.5, 3.0, 7.0], [1.0, 0.25, 2.0]])
    loss, _ = policy_loss(logp, logp_old, logp_rollout, advantages, mask)
    loss.backward()
    # -w A r / 5: (0,1): -2.0 * 0.5 / 5 = -0.2; (1,0): 1.0 * 2.4 / 5 = 0.48; (1,2): 2.0 * 3.0 / 5 = 1.2
    expected = [[0.0, -0.2, 0.0], [0.48, 0.0, 1.2]]
    for row, want in zip(logp.grad.tolist(), expected, strict=True):
        assert row == pytest.approx(want, abs=1e-12)


def test_gradient_never_reaches_old_rollout_or_advantages():
    logp, logp_old, logp_rollout, advantages, mask = example([[0.5, 3.0, 7.0], [1.0, 0.25, 2.0]])
    for tensor in (logp_old, logp_rollout, advantages):
        tensor.requires_grad_(True)
    loss, _ = policy_loss(logp, logp_old, logp_rollout, advantages, mask)
    loss.backward()
    assert logp.grad is not None
    assert logp_old.grad is None and logp_rollout.grad is None and advantages.grad is None


def test_on_policy_loss_is_minus_mean_advantage():
    # logp == logp_old == logp_rollout: ratio 1, w 1, nothing clipped, loss_t = -A_b on every valid token
    torch.manual_seed(1)
    logp = -torch.rand(4, 6, dtype=torch.float64) * 3
    logp.requires_grad_(True)
    mask = t([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    advantages = t([[0.5, -1.0, 2.0, -3.0]])[0]
    loss, metrics = policy_loss(logp, logp.detach(), logp.detach(), advantages, mask)
    # token: -(6 * 0.5 + 2 * -1 + 3 * 2 + 1 * -3) / 12 = -(3 - 2 + 6 - 3) / 12 = -4 / 12
    per_token_advantages = advantages.unsqueeze(1).expand(4, 6)[mask.bool()]
    assert loss.item() == pytest.approx(-per_token_advantages.mean().item(), abs=1e-12)
    assert loss.item() == pytest.approx(-4 / 12, abs=1e-12)
    assert metrics == pytest.approx(
        {"ppo_clip_frac": 0.0, "tis_mean": 1.0, "tis_clip_frac": 0.0, "ratio_mean": 1.0, "logprob_mismatch": 0.0}
    )
    # sequence: -(0.5 - 1 + 2 - 3) / 4 = 0.375
    loss_seq, _ = policy_loss(logp, logp.detach(), logp.detach(), advantages, mask, aggregation="sequence")
    assert loss_seq.item() == pytest.approx(-advantages.mean().item(), abs=1e-12)
    # the policy gradient: d loss / d logp = -A_b / 12 on valid tokens, 0 on padding
    loss.backward()
    assert torch.allclose(logp.grad, -advantages.unsqueeze(1) * mask / 12, atol=1e-12)


def test_zero_advantage_is_never_counted_as_clipped():
    logp_old = torch.zeros(1, 2, dtype=torch.float64)
    logp = logp_old + t([[LOG(3.0), LOG(0.1)]])
    _, metrics = policy_loss(logp, logp_old, logp_old, t([[0.0]])[0], torch.ones(1, 2))
    assert metrics["ppo_clip_frac"] == 0.0


def test_masked_tokens_contribute_nothing():
    logp, logp_old, logp_rollout, advantages, mask = example([[0.5, 3.0, 7.0], [1.0, 0.25, 2.0]])
    loss, metrics = policy_loss(logp, logp_old, logp_rollout, advantages, mask)
    # change every padded input to other garbage, including nan and inf: loss, metrics and gradient hold
    logp2 = logp.detach().clone()
    logp2[0, 2] = float("nan")
    logp2.requires_grad_(True)
    old2, rollout2 = logp_old.clone(), logp_rollout.clone()
    old2[0, 2], rollout2[0, 2] = float("inf"), float("-inf")
    loss2, metrics2 = policy_loss(logp2, old2, rollout2, advantages, mask)
    assert loss2.item() == loss.item()
    assert metrics2 == metrics
    loss.backward()
    loss2.backward()
    assert torch.equal(logp.grad, logp2.grad)
    assert logp2.grad[0, 2] == 0.0


def test_fully_masked_batch_gives_zero_loss_and_metrics():
    logp = torch.zeros(2, 3, requires_grad=True)
    for aggregation in AGGREGATIONS:
        loss, metrics = policy_loss(
            logp, torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3), aggregation=aggregation
        )
        assert loss.item() == 0.0
        assert set(metrics.values()) == {0.0}
        loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3))


def test_policy_loss_checks_shapes_and_names():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"advantages must be \[B\]"):
        policy_loss(x, x, x, torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="logp_rollout has shape"):
        policy_loss(x, x, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"unknown aggregation 'batch'.*token.*sequence"):
        policy_loss(x, x, x, torch.zeros(2), torch.ones(2, 3), aggregation="batch")


# --------------------------------------------------------------------------------------------------
# aggregate


def test_aggregate_token_and_sequence():
    values = t([[1.0, 2.0, 3.0], [10.0, 99.0, 99.0], [5.0, 5.0, 5.0]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # token: (1 + 2 + 3 + 10) / 4 = 4
    assert aggregate(values, mask, "token").item() == 4.0
    # sequence: mean(2, 10) = 6; the empty third sequence is left out
    assert aggregate(values, mask, "sequence").item() == 6.0
    # a bool mask works the same
    assert aggregate(values, mask.bool(), "token").item() == 4.0


def test_aggregate_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"unknown aggregation 'mean'.*\['token', 'sequence'\]"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "mean")


# --------------------------------------------------------------------------------------------------
# KL penalty


def test_kl_forms_on_hand_values():
    # logp = log 0.5, logp_ref = log 0.25: log r = logp_ref - logp = log 0.5 = -0.6931472, r = 0.5
    logp = t([[LOG(0.5), LOG(0.5)]]).requires_grad_(True)
    logp_ref = t([[LOG(0.25), 123.0]])
    mask = t([[1, 0]])
    # k1 = logp - logp_ref = log 2 = 0.6931472
    assert kl_penalty(logp, logp_ref, mask, "k1").tolist()[0] == pytest.approx([LOG(2), 0.0], abs=1e-12)
    # k3 = r - log r - 1 = 0.5 + 0.6931472 - 1 = 0.1931472
    k3 = kl_penalty(logp, logp_ref, mask, "k3")
    assert k3.tolist()[0] == pytest.approx([0.5 + LOG(2) - 1, 0.0], abs=1e-12)
    # low_var: inside [-10, 10], equal to k3
    assert kl_penalty(logp, logp_ref, mask, "low_var").tolist() == k3.tolist()
    # d k3 / d logp = -r + 1 = 0.5; padding 0
    k3.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.5, 0.0], abs=1e-12)


def test_k1_can_be_negative():
    # logp = log 0.25, logp_ref = log 0.5: k1 = -log 2
    kl = kl_penalty(t([[LOG(0.25)]]), t([[LOG(0.5)]]), t([[1]]), "k1")
    assert kl.item() == pytest.approx(-LOG(2))


def test_k3_is_never_negative():
    torch.manual_seed(2)
    logp = torch.randn(64, 32) * 5
    logp_ref = torch.randn(64, 32) * 5
    mask = (torch.rand(64, 32) > 0.2).float()
    for kind in ("k3", "low_var"):
        assert (kl_penalty(logp, logp_ref, mask, kind) >= 0).all()


def test_low_var_clamps_at_ten_with_finite_gradient():
    # log r = logp_ref - logp = 20: k3 = e^20 - 21 = 4.85e8 -> 10; log r = 100: exp would overflow k3 in float32
    logp = torch.tensor([[-20.0, -100.0, -3.0]], requires_grad=True)
    logp_ref = torch.tensor([[0.0, 0.0, -1.0]])
    kl = kl_penalty(logp, logp_ref, torch.ones(1, 3), "low_var")
    # last: log r = 2, k3 = e^2 - 3 = 4.3890561, inside the clamp
    assert kl.tolist()[0] == pytest.approx([10.0, 10.0, math.exp(2) - 3], rel=1e-6)
    assert kl_penalty(logp, logp_ref, torch.ones(1, 3), "k3")[0, 0].item() == pytest.approx(math.exp(20) - 21, rel=1e-6)
    kl.sum().backward()
    # clamped tokens: 0; the last: 1 - r = 1 - e^2
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.0, 1 - math.exp(2)], rel=1e-6)


def test_kl_gradient_only_through_logp():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    logp_ref = torch.tensor([[-1.5, -0.5]], requires_grad=True)
    for kind in KL_ESTIMATORS:
        aggregate(kl_penalty(logp, logp_ref, torch.ones(1, 2), kind), torch.ones(1, 2)).backward()
    assert logp.grad is not None
    assert logp_ref.grad is None


def test_kl_masked_tokens_are_zero_even_with_garbage():
    logp = t([[LOG(0.5), float("nan")]]).requires_grad_(True)
    logp_ref = t([[LOG(0.5), float("inf")]])
    for kind in KL_ESTIMATORS:
        kl = kl_penalty(logp, logp_ref, t([[1, 0]]), kind)
        assert kl.tolist() == [[0.0, 0.0]]
        kl.sum().backward()
    # accumulated over the three kinds: the valid token gets 1 (k1) + 0 (k3, r = 1) + 0 (low_var); padding 0
    assert logp.grad.tolist() == [[1.0, 0.0]]


def test_unknown_kl_kind_lists_the_kinds():
    with pytest.raises(ValueError, match=r"unknown kl kind 'k2'.*\['k1', 'k3', 'low_var'\]"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "k2")

"""The policy losses (ppo, dual_clip, gspo, cispo) composed with a correction, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from workers.training.losses import AGGREGATIONS
from workers.training.policy_losses import POLICY_LOSSES, LossSettings, policy_loss

pytestmark = pytest.mark.workers

LOG = math.log


def t(rows: list[list[float]], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def from_ratios(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """logp (a leaf with grad) and logp_old = log 0.5 with exp(logp - logp_old) = ratios."""
    logp_old = torch.full((len(ratios), len(ratios[0])), LOG(0.5), dtype=torch.float64)
    return (logp_old + t(ratios).log()).requires_grad_(True), logp_old


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
    loss, _ = policy_loss(logp, logp_old, logp_rollout, advantages, mask, LossSettings(aggregation="sequence"))
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

    loss, _ = policy_loss(logp, logp_old, logp_rollout, advantages, mask, LossSettings(aggregation="sequence"))
    # sequence 0: (-0.64 - 1.0) / 2 = -0.82; sequence 1: (2.4 + 0.4 + 6.0) / 3 = 8.8 / 3
    # mean: (-0.82 + 2.9333333) / 2 = 1.0566667
    assert loss.item() == pytest.approx((-0.82 + 8.8 / 3) / 2, abs=1e-12)


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
        {
            "ppo_clip_frac": 0.0,
            "ratio_mean": 1.0,
            "tis_mean": 1.0,
            "tis_max": 1.0,
            "tis_clip_frac": 0.0,
            "tis_masked_frac": 0.0,
            "logprob_mismatch": 0.0,
            "policy/neg_logprob_mean": -logp.detach()[mask.bool()].mean().item(),
        }
    )
    # sequence: -(0.5 - 1 + 2 - 3) / 4 = 0.375
    loss_seq, _ = policy_loss(
        logp, logp.detach(), logp.detach(), advantages, mask, LossSettings(aggregation="sequence")
    )
    assert loss_seq.item() == pytest.approx(-advantages.mean().item(), abs=1e-12)
    # the policy gradient: d loss / d logp = -A_b / 12 on valid tokens, 0 on padding
    loss.backward()
    assert torch.allclose(logp.grad, -advantages.unsqueeze(1) * mask / 12, atol=1e-12)


def test_zero_advantage_is_never_counted_as_clipped():
    logp_old = torch.zeros(1, 2, dtype=torch.float64)
    logp = logp_old + t([[LOG(3.0), LOG(0.1)]])
    _, metrics = policy_loss(logp, logp_old, logp_old, t([[0.0]])[0], torch.ones(1, 2))
    assert metrics["ppo_clip_frac"] == 0.0


def test_neg_logprob_mean_is_the_mean_surprise_of_the_trained_tokens():
    """The sampled entropy estimate: -logp averaged over valid tokens only (padding holds garbage here)."""
    logp = t([[LOG(0.5), LOG(0.25), float("nan")], [LOG(0.125), 0.0, 0.0]]).requires_grad_(True)
    mask = t([[1, 1, 0], [1, 0, 0]])
    _, metrics = policy_loss(logp, logp.detach(), logp.detach(), t([1.0, -1.0]), mask)
    assert metrics["policy/neg_logprob_mean"] == pytest.approx((LOG(2) + LOG(4) + LOG(8)) / 3)


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
            logp,
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            torch.ones(2),
            torch.zeros(2, 3),
            LossSettings(aggregation=aggregation),
        )
        assert loss.item() == 0.0
        assert set(metrics.values()) == {0.0}
        loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3))


def test_policy_loss_checks_shapes_and_names():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"advantages must be \[B\]"):
        policy_loss(x, x, x, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="logp_rollout has shape"):
        policy_loss(x, x, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"unknown aggregation 'batch'.*token.*sequence"):
        policy_loss(x, x, x, torch.zeros(2), torch.ones(2, 3), LossSettings(aggregation="batch"))
    with pytest.raises(ValueError, match=r"unknown loss 'trpo'.*cispo.*dual_clip.*gspo.*ppo"):
        policy_loss(x, x, x, torch.zeros(2), torch.ones(2, 3), LossSettings(loss="trpo"))
    with pytest.raises(ValueError, match="dual-clip c must be above 1"):
        policy_loss(x, x, x, torch.zeros(2), torch.ones(2, 3), LossSettings(loss="dual_clip", loss_options={"c": 1.0}))


# --------------------------------------------------------------------------------------------------
# dual_clip
#
# sequence 0: A = +1, ratios [4, 0.5, 1]    sequence 1: A = -1, ratios [4, 2, 0.5]; c = 3, clip [0.8, 1.28]
#   (0,0) r 4,   A +1: min(4, 1.28) = 1.28 clipped                         loss -1.28, no gradient
#   (0,1) r 0.5, A +1: min(0.5, 0.8) = 0.5                                 loss -0.5
#   (0,2) r 1,   A +1: 1                                                   loss -1
#   (1,0) r 4,   A -1: min(-4, -1.28) = -4 < c A = -3 -> -3 (dual clip)    loss  3, no gradient (ppo: 4)
#   (1,1) r 2,   A -1: min(-2, -1.28) = -2 > -3                            loss  2
#   (1,2) r 0.5, A -1: min(-0.5, -0.8) = -0.8 clipped                      loss  0.8, no gradient


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    logp, logp_old = from_ratios([[4.0, 0.5, 1.0], [4.0, 2.0, 0.5]])
    advantages, mask = t([[1.0, -1.0]])[0], torch.ones(2, 3)
    loss, metrics = policy_loss(
        logp, logp_old, logp_old, advantages, mask, LossSettings(loss="dual_clip", loss_options={"c": 3.0})
    )
    # (-1.28 - 0.5 - 1 + 3 + 2 + 0.8) / 6 = 3.02 / 6
    assert loss.item() == pytest.approx(3.02 / 6, abs=1e-12)
    assert metrics["ppo_clip_frac"] == pytest.approx(3 / 6)
    ppo, _ = policy_loss(logp, logp_old, logp_old, advantages, mask)
    assert ppo.item() == pytest.approx(4.02 / 6, abs=1e-12)
    loss.backward()
    # -A r / 6 on the unclipped tokens: (0,1) -0.5 / 6, (0,2) -1 / 6, (1,1) 2 / 6
    expected = [[0.0, -0.5 / 6, -1 / 6], [0.0, 2 / 6, 0.0]]
    for row, want in zip(logp.grad.tolist(), expected, strict=True):
        assert row == pytest.approx(want, abs=1e-12)


# --------------------------------------------------------------------------------------------------
# gspo
#
# sequence 0: A = +1, ratios [2, 2, pad] -> s = exp(mean(log 2, log 2)) = 2 -> min(2, 1.28) = 1.28, clipped
# sequence 1: A = -1, ratios [1.1, 1.1, 1.1] -> s = 1.1 (inside) -> s A = -1.1, unclipped


def test_gspo_applies_one_clipped_sequence_ratio_to_every_token():
    logp, logp_old = from_ratios([[2.0, 2.0, 1.0], [1.1, 1.1, 1.1]])
    logp.data[0, 2] = float("nan")  # padding
    advantages, mask = t([[1.0, -1.0]])[0], t([[1, 1, 0], [1, 1, 1]])
    loss, metrics = policy_loss(logp, logp_old, logp_old, advantages, mask, LossSettings(loss="gspo"))
    # token: (2 * -1.28 + 3 * 1.1) / 5 = 0.74 / 5 = 0.148
    assert loss.item() == pytest.approx(0.148, abs=1e-12)
    assert metrics["ppo_clip_frac"] == pytest.approx(2 / 5)
    assert metrics["ratio_mean"] == pytest.approx((2 * 2 + 3 * 1.1) / 5, abs=1e-12)
    seq, _ = policy_loss(logp, logp_old, logp_old, advantages, mask, LossSettings(loss="gspo", aggregation="sequence"))
    assert seq.item() == pytest.approx((-1.28 + 1.1) / 2, abs=1e-12)  # the paper's mean over sequences
    loss.backward()
    # sequence 1: loss = (3 / 5) * -s A, d s / d logp_t = s / 3 -> -A s / 5 = 1.1 / 5 = 0.22 per token
    expected = [[0.0, 0.0, 0.0], [0.22, 0.22, 0.22]]
    for row, want in zip(logp.grad.tolist(), expected, strict=True):
        assert row == pytest.approx(want, abs=1e-12)


# --------------------------------------------------------------------------------------------------
# cispo, on the ppo example: weights clip(r) = [[1.28, 0.8, pad], [1.2, 0.8, 1.28]]


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    logp, logp_old, logp_rollout, advantages, mask = example()
    loss, metrics = policy_loss(logp, logp_old, logp_rollout, advantages, mask, LossSettings(loss="cispo"))
    # value -w A: -1.28, -0.8 | 2.4, 1.6, 2.56 -> 4.48 / 5
    assert loss.item() == pytest.approx(4.48 / 5, abs=1e-12)
    assert metrics["ppo_clip_frac"] == pytest.approx(4 / 5)  # every ratio but 1.2 is outside [0.8, 1.28]
    loss.backward()
    # -w A / 5: even the clipped tokens move (unlike ppo, which gives (0,0) and (1,1) no gradient)
    expected = [[-1.28 / 5, -0.8 / 5, 0.0], [2.4 / 5, 1.6 / 5, 2.56 / 5]]
    for row, want in zip(logp.grad.tolist(), expected, strict=True):
        assert row == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_ignores_padding_and_detaches_the_rest(name):
    logp, logp_old, logp_rollout, advantages, mask = example([[0.5, 3.0, 7.0], [1.0, 0.25, 2.0]])
    for tensor in (logp_old, logp_rollout, advantages):
        tensor.requires_grad_(True)
    loss, metrics = policy_loss(logp, logp_old, logp_rollout, advantages, mask, LossSettings(loss=name))
    loss.backward()
    assert logp.grad[0, 2] == 0.0 and bool(torch.isfinite(logp.grad).all())
    assert logp_old.grad is None and logp_rollout.grad is None and advantages.grad is None
    logp2 = logp.detach().clone()
    logp2[0, 2] = float("nan")
    loss2, metrics2 = policy_loss(logp2, logp_old, logp_rollout, advantages, mask, LossSettings(loss=name))
    assert loss2.item() == loss.item() and metrics2 == metrics

"""Aggregation over tokens and the KL penalties against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from workers.training.losses import KL_ESTIMATORS, aggregate, kl_penalty, sequence_mean

pytestmark = pytest.mark.workers

LOG = math.log


def t(rows: list[list[float]], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


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


def test_sequence_mean_over_valid_tokens():
    # [1, 3, pad 99] -> 2; [pad, pad, pad] -> 0; [4, 5, 6] -> 5
    values = t([[1.0, 3.0, 99.0], [7.0, 7.0, 7.0], [4.0, 5.0, 6.0]])
    mask = t([[1, 1, 0], [0, 0, 0], [1, 1, 1]]).bool()
    assert sequence_mean(values, mask).tolist() == [[2.0], [0.0], [5.0]]

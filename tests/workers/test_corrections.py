"""Off-policy corrections (tis, icepop, seq_is, none): weights and metrics against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from tests.workers.test_policy_losses import LOG, t
from workers.training.corrections import (
    CORRECTION_METRICS,
    CORRECTIONS,
    correction_weights,
    icepop_correction,
    no_correction,
    seq_is_correction,
    tis_correction,
    tis_weights,
)

pytestmark = pytest.mark.workers


def logps(raw: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """logp_old, logp_rollout with exp(logp_old - logp_rollout) = raw."""
    logp_rollout = torch.full((len(raw), len(raw[0])), LOG(0.5), dtype=torch.float64)
    return logp_rollout + t(raw).log(), logp_rollout


# --------------------------------------------------------------------------------------------------
# tis


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


def test_tis_clip_frac_counts_both_sides():
    # raw [[0.1, 1.0, 5.0], [0.3, 0.6, 2.5]] with tis range [0.5, 2]: 0.1, 5.0, 0.3, 2.5 outside -> 4 / 6
    raw = t([[0.1, 1.0, 5.0], [0.3, 0.6, 2.5]])
    logp_old = torch.full((2, 3), -1.0, dtype=torch.float64)
    logp_rollout = logp_old - raw.log()
    _, metrics = tis_correction(logp_old, logp_rollout, torch.ones(2, 3), low=0.5, high=2.0)
    assert metrics["tis_clip_frac"] == pytest.approx(4 / 6)
    # w = [0.5, 1.0, 2.0, 0.5, 0.6, 2.0] -> mean 6.6 / 6 = 1.1
    assert metrics["tis_mean"] == pytest.approx(1.1)


def test_tis_reports_max_and_no_masking():
    # raw [[0.25, 1.0, 1.5, 4.0]] with [0, 2]: w [0.25, 1.0, 1.5, 2.0]: max 2.0; only 4.0 outside
    old, rollout = logps([[0.25, 1.0, 1.5, 4.0]])
    _, metrics = tis_correction(old, rollout, torch.ones(1, 4))
    assert metrics["tis_max"] == 2.0
    assert metrics["tis_clip_frac"] == pytest.approx(1 / 4)
    assert metrics["tis_masked_frac"] == 0.0


# --------------------------------------------------------------------------------------------------
# icepop


def test_icepop_masks_tokens_outside_the_band_and_keeps_the_rest_untruncated():
    # raw [[0.25, 1.0, 4.0], [6.0, 0.5, 9.0(masked)]] with [0.5, 5]:
    # 0.25 and 6.0 are outside -> 0; 1.0, 4.0 and 0.5 (on the bound) keep their raw value; padding 0
    old, rollout = logps([[0.25, 1.0, 4.0], [6.0, 0.5, 9.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    w, metrics = icepop_correction(old, rollout, mask)
    assert w.tolist()[0] == pytest.approx([0.0, 1.0, 4.0], abs=1e-12)
    assert w.tolist()[1] == pytest.approx([0.0, 0.5, 0.0], abs=1e-12)
    assert metrics["tis_masked_frac"] == pytest.approx(2 / 5)
    assert metrics["tis_clip_frac"] == pytest.approx(2 / 5)
    assert metrics["tis_mean"] == pytest.approx((1.0 + 4.0 + 0.5) / 5)  # 1.1
    assert metrics["tis_max"] == pytest.approx(4.0)


# --------------------------------------------------------------------------------------------------
# seq_is


def test_seq_is_takes_the_geometric_mean_per_sequence():
    # sequence 0: raw [2, 8] -> exp((log 2 + log 8) / 2) = sqrt(16) = 4 -> clipped to 2 on both tokens
    # sequence 1: raw [0.5, 2, pad 100] -> sqrt(1) = 1 on its two tokens; padding 0
    old, rollout = logps([[2.0, 8.0, 1.0], [0.5, 2.0, 100.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    w, metrics = seq_is_correction(old, rollout, mask, low=0.0, high=2.0)
    assert w.tolist()[0] == pytest.approx([2.0, 2.0, 0.0], abs=1e-12)
    assert w.tolist()[1] == pytest.approx([1.0, 1.0, 0.0], abs=1e-12)
    assert metrics["tis_clip_frac"] == pytest.approx(2 / 4)  # sequence 0's two tokens
    assert metrics["tis_mean"] == pytest.approx(1.5)
    assert metrics["tis_max"] == pytest.approx(2.0)
    # the per-token mismatch is still per token: (log 2 + log 8 + log 2 + log 2) / 4 = 6 log 2 / 4
    assert metrics["logprob_mismatch"] == pytest.approx(6 * LOG(2) / 4, abs=1e-12)


# --------------------------------------------------------------------------------------------------
# none, the registry


def test_none_weighs_every_valid_token_one():
    old, rollout = logps([[3.0, 0.1], [1.0, 7.0]])
    w, metrics = no_correction(old, rollout, t([[1, 1], [1, 0]]))
    assert w.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert metrics["tis_mean"] == 1.0 and metrics["tis_max"] == 1.0
    assert metrics["tis_clip_frac"] == 0.0 and metrics["tis_masked_frac"] == 0.0
    assert metrics["logprob_mismatch"] == pytest.approx((LOG(3) + LOG(10) + 0.0) / 3, abs=1e-12)


@pytest.mark.parametrize("kind", sorted(CORRECTIONS))
def test_every_correction_reports_the_same_metrics_and_is_detached(kind):
    old = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    rollout = torch.tensor([[-1.5, -1.0]], requires_grad=True)
    w, metrics = correction_weights(old, rollout, torch.ones(1, 2), kind)
    assert set(metrics) == set(CORRECTION_METRICS)
    assert not w.requires_grad


@pytest.mark.parametrize("kind", sorted(CORRECTIONS))
def test_every_correction_gives_zero_metrics_on_an_empty_batch(kind):
    w, metrics = correction_weights(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), kind)
    assert w.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert set(metrics.values()) == {0.0}


def test_unknown_correction_and_unordered_bounds():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match=r"unknown correction 'is'.*icepop.*none.*seq_is.*tis"):
        correction_weights(x, x, torch.ones(1, 1), "is")
    with pytest.raises(ValueError, match=r"icepop low 3\.0 is above icepop high 2\.0"):
        correction_weights(x, x, torch.ones(1, 1), "icepop", low=3.0, high=2.0)

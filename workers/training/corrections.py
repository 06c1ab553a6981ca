"""Off-policy corrections: a detached per-token weight for the gap between the trainer's and the rollout
engine's policy.

The samples come from the rollout engine's policy, which may be several versions old (see
docs/architecture.md, "Staleness: one number") and numerically differs from the trainer's forward even
when the versions match (other kernels, other precision). The loss's trust region is anchored on the
trainer's old log-probs (decoupled PPO); the correction reweights each token for the remaining gap.

    logp_old      log pi_old(y_t)      the trainer's own forward at the start of the step   # [B, T]
    logp_rollout  log pi_behave(y_t)   what the rollout engine reported while sampling      # [B, T]
    mask          1 on real response tokens                                                 # [B, T]
    rho           exp(logp_old - logp_rollout)                                              # [B, T]

    tis     w[b,t] = clip(rho[b,t], low, high)                        truncated IS (Yao et al., 2025)
    icepop  w[b,t] = rho[b,t] if low <= rho[b,t] <= high, else 0      IcePop (Ling team, 2025)
    seq_is  w[b,t] = clip(exp(mean_t log rho[b,t]), low, high)        one weight per sequence
    none    w[b,t] = 1

w multiplies each token's loss term (`workers.training.policy_losses.policy_loss`) and is never
differentiated; it is 0 on padding. How this deviates from the papers:

- `icepop` masks a token by giving it weight 0: it still counts in the loss's denominator (IcePop's
  M(k) = 0 inside the per-sequence sum), so masking never rescales the other tokens, and micro-batches
  keep the whole batch's normalisation.
- `seq_is` takes the geometric mean of the token ratios (the length-normalised sequence ratio, as GSPO
  does for the policy ratio) instead of their product, which under- or overflows on long responses.

Every correction reports the same metrics over the valid tokens, so dashboards need not know which
one runs: tis_mean and tis_max (of w), tis_clip_frac (rho, or the sequence's weight for seq_is, outside
[low, high]: truncated or masked), tis_masked_frac (w == 0 because the token was masked out) and
logprob_mismatch (mean |logp_old - logp_rollout|).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from workers.training.losses import check_shapes, masked, masked_mean, sequence_mean, valid_of

Correction = Callable[..., tuple[Tensor, dict[str, float]]]
CORRECTION_METRICS = ("tis_mean", "tis_max", "tis_clip_frac", "tis_masked_frac", "logprob_mismatch")


def _check_bounds(name: str, low: float, high: float) -> None:
    if low > high:
        raise ValueError(f"{name} low {low} is above {name} high {high}")


def _log_rho(logp_old: Tensor, logp_rollout: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """log rho = logp_old - logp_rollout, detached, 0 on padding; and the valid tokens. All [B, T]."""
    check_shapes(mask, logp_old=logp_old, logp_rollout=logp_rollout)
    valid = valid_of(mask)
    return masked(logp_old.detach() - logp_rollout.detach(), valid), valid


def _metrics(w: Tensor, outside: Tensor, dropped: Tensor, log_rho: Tensor, valid: Tensor) -> dict[str, float]:
    """The shared metrics: w, log_rho [B, T]; outside, dropped [B, T] bool; over the valid tokens."""
    with torch.no_grad():
        return {
            "tis_mean": masked_mean(w, valid),
            "tis_max": float(masked(w, valid).max()) if bool(valid.any()) else 0.0,
            "tis_clip_frac": masked_mean(outside.to(w.dtype), valid),
            "tis_masked_frac": masked_mean(dropped.to(w.dtype), valid),
            "logprob_mismatch": masked_mean(log_rho.abs(), valid),
        }


def tis_weights(
    logp_old: Tensor,
    logp_rollout: Tensor,
    mask: Tensor,
    low: float = 0.0,
    high: float = 2.0,
) -> Tensor:
    """Truncated importance weights of the trainer's old policy over the rollout engine's policy.

    logp_old, logp_rollout, mask: [B, T] -> w [B, T], detached:
    w[b,t] = clip(exp(logp_old[b,t] - logp_rollout[b,t]), low, high) where mask is 1, 0 elsewhere.
    """
    _check_bounds("tis", low, high)
    log_rho, valid = _log_rho(logp_old, logp_rollout, mask)
    return masked(log_rho.exp().clamp(low, high), valid)


def tis_correction(
    logp_old: Tensor, logp_rollout: Tensor, mask: Tensor, low: float = 0.0, high: float = 2.0
) -> tuple[Tensor, dict[str, float]]:
    """tis: w = clip(rho, low, high) per token. [B, T] x 3 -> (w [B, T], metrics)."""
    w = tis_weights(logp_old, logp_rollout, mask, low, high)
    log_rho, valid = _log_rho(logp_old, logp_rollout, mask)
    rho = log_rho.exp()  # [B, T]
    return w, _metrics(w, (rho < low) | (rho > high), torch.zeros_like(valid), log_rho, valid)


def icepop_correction(
    logp_old: Tensor, logp_rollout: Tensor, mask: Tensor, low: float = 0.5, high: float = 5.0
) -> tuple[Tensor, dict[str, float]]:
    """icepop: w = rho where low <= rho <= high, 0 (masked out of the loss) elsewhere. [B, T] x 3 -> (w, metrics)."""
    _check_bounds("icepop", low, high)
    log_rho, valid = _log_rho(logp_old, logp_rollout, mask)
    rho = log_rho.exp()  # [B, T]
    outside = (rho < low) | (rho > high)  # [B, T]
    w = masked(rho, valid & ~outside)  # [B, T]
    return w, _metrics(w, outside, outside & valid, log_rho, valid)


def seq_is_correction(
    logp_old: Tensor, logp_rollout: Tensor, mask: Tensor, low: float = 0.0, high: float = 2.0
) -> tuple[Tensor, dict[str, float]]:
    """seq_is: w_b = clip(exp(mean_t log rho[b, t]), low, high) on all of sequence b's tokens.

    logp_old, logp_rollout, mask: [B, T] -> (w [B, T], metrics); the mean is over the sequence's valid tokens.
    """
    _check_bounds("seq_is", low, high)
    log_rho, valid = _log_rho(logp_old, logp_rollout, mask)
    raw = sequence_mean(log_rho, valid).exp()  # [B, 1], the geometric mean of rho
    w = masked(raw.clamp(low, high).expand_as(log_rho), valid)  # [B, T]
    outside = ((raw < low) | (raw > high)).expand_as(valid)  # [B, T]
    return w, _metrics(w, outside, torch.zeros_like(valid), log_rho, valid)


def no_correction(logp_old: Tensor, logp_rollout: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, float]]:
    """none: w = 1 on every valid token (the mismatch is still reported). [B, T] x 3 -> (w, metrics)."""
    log_rho, valid = _log_rho(logp_old, logp_rollout, mask)
    w = valid.to(log_rho.dtype)  # [B, T]
    none = torch.zeros_like(valid)
    return w, _metrics(w, none, none, log_rho, valid)


CORRECTIONS: dict[str, Correction] = {
    "tis": tis_correction,
    "icepop": icepop_correction,
    "seq_is": seq_is_correction,
    "none": no_correction,
}


def correction_weights(
    logp_old: Tensor, logp_rollout: Tensor, mask: Tensor, kind: str = "tis", **options: Any
) -> tuple[Tensor, dict[str, float]]:
    """The correction named `kind` with its options (`low`, `high`): ([B, T] x 3) -> (w [B, T] detached, metrics)."""
    try:
        correction = CORRECTIONS[kind]
    except KeyError:
        raise ValueError(f"unknown correction {kind!r}; valid: {sorted(CORRECTIONS)}") from None
    return correction(logp_old, logp_rollout, mask, **options)

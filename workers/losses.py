"""The actor's loss: decoupled PPO with truncated importance sampling, and a KL penalty, as pure functions.

Shapes: B sequences (responses) in the batch, T response tokens (right-padded).

    logp          log pi_theta(y_t)        the policy being trained, carries the gradient   # [B, T]
    logp_old      log pi_old(y_t)          the trainer's own forward at the start of the step # [B, T]
    logp_rollout  log pi_behave(y_t)       what the rollout engine reported while sampling   # [B, T]
    mask          1 on real response tokens, 0 on padding / prompt                          # [B, T]
    A             one advantage per sequence, broadcast over its tokens                     # [B]

    ratio  = exp(logp - logp_old)
    w      = clip(exp(logp_old - logp_rollout), tis_low, tis_high)           detached
    loss_t = -w * min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    loss   = aggregate(loss_t, mask)                                         "token" or "sequence"

How this deviates from the textbook PPO/GRPO objective:

- Decoupled PPO (Hilton et al., 2022; AReaL): the samples come from the rollout engine's policy,
  which may be several versions old (see ARCHITECTURE.md, "Staleness") and numerically differs from
  the trainer's forward even when the versions match (other kernels, other precision). The trust
  region is anchored on the trainer's old log-probs, not on the behaviour policy, and the gap
  between the two is corrected by a per-token truncated importance weight w (TIS; Yao et al., 2025).
  w is detached: it rescales the gradient, it is never differentiated.
- Clip-higher (DAPO): the clip range is asymmetric, [1 - 0.2, 1 + 0.28] by default.
- No dual clip and no value function; advantages come from `workers.advantages`.
- Aggregation: "token" (DAPO, the default) divides the sum over all valid tokens of the batch by
  their number, so long responses are not down-weighted; "sequence" is the GRPO paper's mean over
  sequences of the per-sequence token mean. Sequences without a valid token are left out of it.
- KL: a separate per-token penalty against a reference model (k1, k3 or verl's clamped "low_var"
  k3), to be added to the loss by the trainer, not folded into the reward.

Only `logp` carries a gradient: logp_old, logp_rollout and logp_ref are detached here. Masked
positions are zeroed before any arithmetic, so padding may hold any value, even inf or nan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

AGGREGATIONS = ("token", "sequence")


def _valid(mask: Tensor) -> Tensor:
    """mask [B, T] of 0/1 (any dtype) -> bool [B, T]."""
    return mask.bool()


def _masked(values: Tensor, valid: Tensor) -> Tensor:
    """values where valid, exact 0 elsewhere; the gradient to masked positions is 0, never nan."""
    return torch.where(valid, values, torch.zeros_like(values))


def _check_shapes(mask: Tensor, **tensors: Tensor) -> None:
    """Every tensor must have the mask's shape [B, T]."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    for name, tensor in tensors.items():
        if tensor.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, mask has {tuple(mask.shape)}")


def _masked_mean(values: Tensor, valid: Tensor) -> float:
    """Mean of values over valid tokens as a float; 0.0 when there is none. values, valid: [B, T]."""
    count = int(valid.sum())
    return float(_masked(values, valid).sum()) / count if count else 0.0


def aggregate(values: Tensor, mask: Tensor, aggregation: str = "token") -> Tensor:
    """Reduce per-token values to a scalar over the valid tokens.

    values, mask: [B, T] -> scalar.
    "token":    sum_{b,t} m[b,t] v[b,t] / sum_{b,t} m[b,t]                       (DAPO token-level)
    "sequence": mean over sequences with n_b > 0 of (sum_t m[b,t] v[b,t] / n_b),  n_b = sum_t m[b,t]
    Both give 0 (still attached to the graph) when no token is valid.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; valid: {list(AGGREGATIONS)}")
    _check_shapes(mask, values=values)
    valid = _valid(mask)
    summed = _masked(values, valid)  # [B, T]
    if aggregation == "token":
        return summed.sum() / valid.sum().clamp(min=1)
    counts = valid.sum(dim=1)  # [B]
    per_sequence = summed.sum(dim=1) / counts.clamp(min=1)  # [B]
    return per_sequence.sum() / (counts > 0).sum().clamp(min=1)


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
    if low > high:
        raise ValueError(f"tis low {low} is above tis high {high}")
    _check_shapes(mask, logp_old=logp_old, logp_rollout=logp_rollout)
    valid = _valid(mask)
    log_ratio = _masked(logp_old.detach() - logp_rollout.detach(), valid)  # [B, T]
    return _masked(log_ratio.exp().clamp(low, high), valid)


def policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    logp_rollout: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    tis_low: float = 0.0,
    tis_high: float = 2.0,
    aggregation: str = "token",
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO clipped surrogate with TIS off-policy correction.

    logp, logp_old, logp_rollout, mask: [B, T]; advantages: [B] -> (loss scalar, metrics).
    ratio = exp(logp - logp_old)                                                  # [B, T]
    loss_t = -w * min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A),  w = tis_weights(...)
    loss = aggregate(loss_t, mask, aggregation)
    Metrics, over valid tokens: ppo_clip_frac (the clipped branch is the smaller one, so the token has
    no gradient), tis_mean, tis_clip_frac (exp(logp_old - logp_rollout) outside [tis_low, tis_high]),
    ratio_mean, logprob_mismatch (mean |logp_old - logp_rollout|).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; valid: {list(AGGREGATIONS)}")
    _check_shapes(mask, logp=logp, logp_old=logp_old, logp_rollout=logp_rollout)
    if advantages.shape != mask.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{mask.shape[0]}], got shape {tuple(advantages.shape)}")
    valid = _valid(mask)
    log_ratio = _masked(logp, valid) - _masked(logp_old.detach(), valid)  # [B, T], 0 on padding
    ratio = log_ratio.exp()  # [B, T]
    adv = advantages.detach().to(ratio.dtype).unsqueeze(1)  # [B, 1]
    unclipped = ratio * adv  # [B, T]
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv  # [B, T]
    clip_active = clipped < unclipped  # [B, T]; ties keep the unclipped branch and its gradient
    surrogate = torch.where(clip_active, clipped, unclipped)  # [B, T] = min(unclipped, clipped)
    w = tis_weights(logp_old, logp_rollout, mask, tis_low, tis_high)  # [B, T], detached
    loss = aggregate(-w * surrogate, mask, aggregation)

    with torch.no_grad():
        gap = _masked(logp_old - logp_rollout, valid)  # [B, T]
        raw_w = gap.exp()  # [B, T]
        metrics = {
            "ppo_clip_frac": _masked_mean(clip_active.to(ratio.dtype), valid),
            "tis_mean": _masked_mean(w, valid),
            "tis_clip_frac": _masked_mean(((raw_w < tis_low) | (raw_w > tis_high)).to(ratio.dtype), valid),
            "ratio_mean": _masked_mean(ratio, valid),
            "logprob_mismatch": _masked_mean(gap.abs(), valid),
        }
    return loss, metrics


def _kl_k1(log_ratio: Tensor) -> Tensor:
    """k1 = logp - logp_ref = -log_ratio, unbiased, can be negative. log_ratio = logp_ref - logp: [B, T]."""
    return -log_ratio


def _kl_k3(log_ratio: Tensor) -> Tensor:
    """k3 = exp(log_ratio) - log_ratio - 1 >= 0, unbiased, low variance. log_ratio = logp_ref - logp: [B, T]."""
    return log_ratio.exp() - log_ratio - 1.0


def _kl_low_var(log_ratio: Tensor) -> Tensor:
    """verl's low_var_kl: k3 on log_ratio clamped to [-20, 20] (so exp never overflows), then clamped to [-10, 10]."""
    return _kl_k3(log_ratio.clamp(-20.0, 20.0)).clamp(-10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": _kl_k1,
    "k3": _kl_k3,
    "low_var": _kl_low_var,
}


def kl_penalty(logp: Tensor, logp_ref: Tensor, mask: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimates of KL(pi || pi_ref) from tokens sampled by pi (Schulman's k1 / k3).

    logp, logp_ref, mask: [B, T] -> kl [B, T], 0 where mask is 0. With r = pi_ref / pi = exp(logp_ref - logp):
    "k1": logp - logp_ref;   "k3": r - log r - 1;   "low_var": k3 clamped to [-10, 10] (log r first to [-20, 20]).
    Reduce it with `aggregate`. The gradient flows through logp only.
    """
    try:
        estimator = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown kl kind {kind!r}; valid: {list(KL_ESTIMATORS)}") from None
    _check_shapes(mask, logp=logp, logp_ref=logp_ref)
    valid = _valid(mask)
    log_ratio = _masked(logp_ref.detach(), valid) - _masked(logp, valid)  # [B, T], 0 on padding
    return _masked(estimator(log_ratio), valid)

"""What every term of the actor's loss shares: masking, aggregation over tokens, and the KL penalty.

Shapes: B sequences (responses) in the batch, T response tokens (right-padded).

    values        any per-token quantity (a loss term, a KL estimate)                       # [B, T]
    mask          1 on real response tokens, 0 on padding / prompt                          # [B, T]
    logp          log pi_theta(y_t)        the policy being trained, carries the gradient   # [B, T]
    logp_ref      log pi_ref(y_t)          the reference model                              # [B, T]

The policy-gradient surrogates live in `workers.training.policy_losses` (`ppo`, `dual_clip`, `gspo`,
`cispo`; `policy_loss` composes one with an off-policy correction), the off-policy corrections in
`workers.training.corrections` (`tis`, `icepop`, `seq_is`, `none`); docs/algorithms.md has the table.

- Aggregation: "token" (DAPO, the default) divides the sum over all valid tokens of the batch by
  their number, so long responses are not down-weighted; "sequence" is the GRPO paper's mean over
  sequences of the per-sequence token mean. Sequences without a valid token are left out of it.
- KL: a separate per-token penalty against a reference model (k1, k3 or verl's clamped "low_var"
  k3), to be added to the loss by the trainer, not folded into the reward.

Only `logp` carries a gradient. Masked positions are zeroed before any arithmetic, so padding may hold
any value, even inf or nan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

AGGREGATIONS = ("token", "sequence")


def valid_of(mask: Tensor) -> Tensor:
    """mask [B, T] of 0/1 (any dtype) -> bool [B, T]."""
    return mask.bool()


def masked(values: Tensor, valid: Tensor) -> Tensor:
    """values where valid, exact 0 elsewhere; the gradient to masked positions is 0, never nan."""
    return torch.where(valid, values, torch.zeros_like(values))


def check_shapes(mask: Tensor, **tensors: Tensor) -> None:
    """Every tensor must have the mask's shape [B, T]."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    for name, tensor in tensors.items():
        if tensor.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, mask has {tuple(mask.shape)}")


def masked_mean(values: Tensor, valid: Tensor) -> float:
    """Mean of values over valid tokens as a float; 0.0 when there is none. values, valid: [B, T]."""
    count = int(valid.sum())
    return float(masked(values, valid).sum()) / count if count else 0.0


def sequence_mean(values: Tensor, valid: Tensor) -> Tensor:
    """Per-sequence mean over valid tokens: values, valid [B, T] -> [B, 1]; 0 for a sequence without one."""
    counts = valid.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1]
    return masked(values, valid).sum(dim=1, keepdim=True) / counts


def aggregate(values: Tensor, mask: Tensor, aggregation: str = "token", normalizer: float | None = None) -> Tensor:
    """Reduce per-token values to a scalar over the valid tokens.

    values, mask: [B, T] -> scalar.
    "token":    sum_{b,t} m[b,t] v[b,t] / sum_{b,t} m[b,t]                       (DAPO token-level)
    "sequence": mean over sequences with n_b > 0 of (sum_t m[b,t] v[b,t] / n_b),  n_b = sum_t m[b,t]
    Both give 0 (still attached to the graph) when no token is valid.
    `normalizer` replaces the denominator (valid tokens, or sequences with a valid token) by a count
    taken over a larger batch: a micro-batch's share of the whole batch's loss, so that summing the
    micro-batches' values (and gradients) gives exactly the whole-batch value.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; valid: {list(AGGREGATIONS)}")
    check_shapes(mask, values=values)
    valid = valid_of(mask)
    summed = masked(values, valid)  # [B, T]
    if aggregation == "token":
        return summed.sum() / (valid.sum().clamp(min=1) if normalizer is None else max(normalizer, 1.0))
    counts = valid.sum(dim=1)  # [B]
    per_sequence = summed.sum(dim=1) / counts.clamp(min=1)  # [B]
    return per_sequence.sum() / ((counts > 0).sum().clamp(min=1) if normalizer is None else max(normalizer, 1.0))


def normalizer_of(mask: Tensor, aggregation: str) -> float:
    """The denominator `aggregate` uses for `mask` [B, T]: valid tokens ("token") or sequences with one ("sequence")."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; valid: {list(AGGREGATIONS)}")
    valid = valid_of(mask)
    return float(valid.sum() if aggregation == "token" else (valid.sum(dim=1) > 0).sum())


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
    check_shapes(mask, logp=logp, logp_ref=logp_ref)
    valid = valid_of(mask)
    log_ratio = masked(logp_ref.detach(), valid) - masked(logp, valid)  # [B, T], 0 on padding
    return masked(estimator(log_ratio), valid)


class KlTerm:
    """The loss's KL term: `coef` x KL(pi || pi_ref) per token (`kind`), aggregated like the policy loss.

    Called with the micro-batch's loss, it returns the loss with the term added and the term's value as `kl`;
    a batch without the reference's log-probs is returned unchanged. A run whose `trainer.kl.coef` is 0 uses
    `no_kl` instead (chosen once, when the trainer is built)."""

    def __init__(self, coef: float, kind: str, aggregation: str) -> None:
        self.coef, self.kind, self.aggregation = coef, kind, aggregation

    def __call__(
        self, loss: Tensor, logp: Tensor, ref_logp: Tensor | None, mask: Tensor, normalizer: float | None
    ) -> tuple[Tensor, dict[str, float]]:
        if ref_logp is None:
            return loss, {}
        kl = aggregate(kl_penalty(logp, ref_logp, mask, self.kind), mask, self.aggregation, normalizer)
        return loss + self.coef * kl, {"kl": float(kl.detach())}


def no_kl(
    loss: Tensor, logp: Tensor, ref_logp: Tensor | None, mask: Tensor, normalizer: float | None
) -> tuple[Tensor, dict[str, float]]:
    """No KL term: the loss as it is."""
    return loss, {}

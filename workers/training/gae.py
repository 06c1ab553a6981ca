"""PPO with GAE: per-token advantages from the reward and a critic's values, the critic's returns and its loss.

Shapes: B sequences, T response tokens laid out as `workers.training.batch.Batch.mask` (1 on the tokens the policy
sampled, 0 on the prompt and padding). The reward is one number per response, given at its last valid token.

    r_t      = R_b at the last valid token of row b, else 0                                  # [B, T]
    delta_t  = r_t + gamma V_{t'} - V_t     t' the next valid token of the row (V = 0 after the last one)
    A_t      = delta_t + gamma lam A_{t'}                                                     # [B, T]
    R_t      = A_t + V_t                    the critic's returns (its regression target)      # [B, T]

    value loss  0.5 * mean_valid max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)      (PPO's clipped one)

How this deviates from the textbook: the "next" state skips masked positions rather than following the tensor's
columns, so a hole in the mask (none in a plain response) is stepped over, not treated as the end; gamma and lam
apply per sampled token. A_t is not whitened. With gamma = lam = 1, A_t = R_b - V_t: a per-token baseline under the
Monte-Carlo return; with lam = 0, the one-step TD error. Everything outside the mask is an exact 0, so padding may
hold any value.
"""

from __future__ import annotations

import torch
from torch import Tensor

from workers.training.distill import StepTokens
from workers.training.losses import check_shapes, masked, masked_mean


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns: rewards [B], values, mask [B, T] -> (A [B, T], R = A + V [B, T]), 0 where masked.

    See the module docstring for the formulas; computed backwards over T with the next valid token's value and
    advantage carried across masked positions.
    """
    check_shapes(mask, values=values)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards must be [B] = [{mask.shape[0]}], got {list(rewards.shape)}")
    valid = mask.bool()
    v = masked(values.detach().float(), valid)  # [B, T]
    adv = torch.zeros_like(v)  # [B, T]
    next_value = torch.zeros(
        v.shape[0], dtype=v.dtype, device=v.device
    )  # [B]: V of the next valid token (0 after the last)
    next_adv = torch.zeros_like(next_value)  # [B]
    seen = torch.zeros(v.shape[0], dtype=torch.bool, device=v.device)  # [B]: a valid token after t exists
    reward = rewards.detach().to(v.dtype)  # [B]
    for t in range(v.shape[1] - 1, -1, -1):
        here = valid[:, t]  # [B]
        r_t = torch.where(seen, torch.zeros_like(reward), reward)  # the reward at the row's last valid token
        delta = r_t + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(here, a_t, torch.zeros_like(a_t))
        next_value = torch.where(here, v[:, t], next_value)
        next_adv = torch.where(here, a_t, next_adv)
        seen = seen | here
    return adv, masked(adv + v, valid)


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float
) -> tuple[Tensor, float]:
    """PPO's clipped value loss and the fraction of tokens where the clipped branch is the larger.

    values (with grad), old_values, returns, mask: [B, T] -> (0.5 * mean over valid of max((V - R)^2,
    (V_old + clamp(V - V_old, -clip, clip) - R)^2), clip fraction). A scalar 0 (with grad) without a valid token.
    """
    check_shapes(mask, values=values, old_values=old_values, returns=returns)
    valid = mask.bool()
    old, target = old_values.detach().to(values.dtype), returns.detach().to(values.dtype)
    clipped = old + (values - old).clamp(-clip, clip)  # [B, T]
    plain_sq, clipped_sq = (values - target).pow(2), (clipped - target).pow(2)
    per_token = masked(torch.maximum(plain_sq, clipped_sq), valid)  # [B, T]
    count = valid.sum()
    loss = 0.5 * per_token.sum() / count.clamp(min=1)
    frac = masked_mean((clipped_sq > plain_sq).float(), valid)
    return loss, frac


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over valid tokens (population variances): values, returns, mask [B, T] -> float.
    1 is a perfect critic, 0 one no better than a constant, negative worse; 0.0 when Var(R) is 0 or nothing is
    valid."""
    check_shapes(mask, values=values, returns=returns)
    valid = mask.bool()
    if not bool(valid.any()):
        return 0.0
    r, v = returns.detach()[valid].double(), values.detach()[valid].double()
    var_r = float(r.var(unbiased=False))
    if var_r == 0.0:
        return 0.0
    return 1.0 - float((r - v).var(unbiased=False)) / var_r


class GaeTerm:
    """The actor's `gae` advantage: per-token A_t from a step's rewards ([N], one per row: what the trainer passes as
    its sequence advantages under `gae`) and the critic's values ([N, T])."""

    def __init__(self, gamma: float, lam: float) -> None:
        self.gamma, self.lam = gamma, lam

    def __call__(self, seq_adv: Tensor, tokens: StepTokens) -> tuple[Tensor, dict[str, float]]:
        mask = tokens.mask
        if tokens.values is None:
            raise ValueError("a run with a critic got a batch without the critic's values")
        with torch.no_grad():
            adv, _ = gae(seq_adv.to(mask.device), tokens.values.to(mask.device), mask, self.gamma, self.lam)
        return adv, {"gae_advantage_mean": masked_mean(adv, mask.bool())}

"""Group-relative advantages, as small pure functions over one reward per sampled response.

    r[g, i]   reward of response i in prompt group g           # [groups, samples]
    mean_g    (1/n) sum_i r[g, i]
    std_g     sqrt((1/n) sum_i (r[g, i] - mean_g)^2)           population std (unbiased=False)

    grpo      A[g, i] = (r[g, i] - mean_g) / (std_g + eps)
    drgrpo    A[g, i] =  r[g, i] - mean_g

How this deviates from the textbook:

- The GRPO paper (Shao et al., 2024) does not say which std it divides by, and many implementations
  use the sample std (n - 1). We use the population std, so a group of two responses with rewards
  [1, 0] gets exactly [+1, -1] (before eps) and a group of one is well defined.
- A group whose rewards are all equal carries no learning signal and gets exact zeros, in both modes.
  Textbook GRPO yields 0 / (0 + eps) = 0 only if the mean is exact; here it is zeroed explicitly, so
  float rounding in the mean can never turn into a spurious advantage of size rounding / eps.
- Dr. GRPO (Liu et al., 2025) drops the std division here; its second change, no per-response length
  normalisation, belongs to the loss (`workers.losses.aggregate`, "token" aggregation).
- One advantage per response: it is broadcast over the response's tokens by the loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

AdvantageEstimator = Callable[[Tensor, float], Tensor]


def _centred(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """r - mean_g and a mask of groups whose rewards are all equal.

    rewards: [groups, samples] -> (centred [groups, samples], flat [groups, 1] bool)
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
    rewards = rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # [groups, samples]
    flat = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)  # [groups, 1]
    return centred, flat


def grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: A = (r - mean_g) / (std_g + eps), std_g the population std (unbiased=False).

    rewards: [groups, samples] -> advantages [groups, samples]; all-equal groups give exact zeros.
    """
    centred, flat = _centred(rewards)  # [groups, samples], [groups, 1]
    std = centred.pow(2).mean(dim=1, keepdim=True).sqrt()  # [groups, 1], population std
    advantages = centred / (std + eps)  # [groups, samples]
    return torch.where(flat, torch.zeros_like(advantages), advantages)


def drgrpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """Dr. GRPO: A = r - mean_g (no division by the std; eps is unused, kept for one signature).

    rewards: [groups, samples] -> advantages [groups, samples]; all-equal groups give exact zeros.
    """
    del eps  # the registry passes it to every estimator; this one has nothing to divide
    centred, flat = _centred(rewards)  # [groups, samples], [groups, 1]
    return torch.where(flat, torch.zeros_like(centred), centred)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
}


def group_advantages(rewards: Tensor, mode: str = "grpo", eps: float = 1e-6) -> Tensor:
    """Advantages of every response relative to its own prompt group, by the estimator named `mode`.

    rewards: [groups, samples] -> advantages [groups, samples]. See the module docstring for the formulas.
    """
    try:
        estimator = ADVANTAGE_ESTIMATORS[mode]
    except KeyError:
        raise ValueError(f"unknown advantage mode {mode!r}; valid: {sorted(ADVANTAGE_ESTIMATORS)}") from None
    return estimator(rewards, eps)

"""Advantages, as small pure functions over one reward per sampled response, and the reward shaping before them.

    r[g, i]   reward of response i in prompt group g           # [groups, samples], n samples per group
    mean_g    (1/n) sum_i r[g, i]
    std_g     sqrt((1/n) sum_i (r[g, i] - mean_g)^2)           population std (unbiased=False)
    mean_B, std_B   the same over every response of the batch (the trainer step's groups)

    grpo                   A[g, i] = (r[g, i] - mean_g) / (std_g + eps)
    drgrpo                 A[g, i] =  r[g, i] - mean_g
    rloo                   A[g, i] =  r[g, i] - mean_{j != i} r[g, j]  =  n / (n - 1) * (r[g, i] - mean_g)
    reinforce_pp           A[g, i] = (r[g, i] - mean_B) / (std_B + eps)
    reinforce_pp_baseline  A[g, i] = (r[g, i] - mean_g) / (std_B(r - mean_g) + eps)
    gae                    r[g, i] itself: the per-token advantages come from it and a critic's values
                           (`workers.training.gae`)

    whiten (any estimator) A <- (A - mean_B(A)) / (std_B(A) + eps)

How this deviates from the textbook:

- The GRPO paper (Shao et al., 2024) does not say which std it divides by, and many implementations
  use the sample std (n - 1). We use the population std, so a group of two responses with rewards
  [1, 0] gets exactly [+1, -1] (before eps) and a group of one is well defined.
- A group whose rewards are all equal carries no learning signal and gets exact zeros in every
  estimator with a group baseline (all but `reinforce_pp`), whitened or not. Textbook GRPO yields
  0 / (0 + eps) = 0 only if the mean is exact; here it is zeroed explicitly, so float rounding in the
  mean can never turn into a spurious advantage of size rounding / eps. Whitening, which shifts every
  advantage by the batch mean, restores those zeros afterwards. A group of one response is all-equal.
- Dr. GRPO (Liu et al., 2025) drops the std division here; its second change, no per-response length
  normalisation, belongs to the loss (`workers.training.losses.aggregate`, "token" aggregation).
- RLOO (Ahmadian et al., 2024) as the leave-one-out mean of the other n - 1 rewards of the group.
- REINFORCE++ (Hu, 2025) whitens token-level discounted returns that include a KL reward penalty over
  the batch's tokens. Here the reward is one number per response, the KL is a separate loss term
  (`trainer.kl.coef`), and the batch statistics are over responses, not tokens (a long response does
  not weigh more in mean_B and std_B). `reinforce_pp_baseline` (REINFORCE++-baseline) subtracts the
  group mean first; its batch mean is then zero in exact arithmetic and is not subtracted again, so
  the exact zeros of all-equal groups survive.
- One advantage per response: it is broadcast over the response's tokens by the loss.

DAPO's overlong reward shaping (`overlong_penalty`) is added to the rewards before any estimator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from workers.config.trainer import OverlongConfig
    from workers.training.batch import Batch

AdvantageEstimator = Callable[[Tensor, float], Tensor]


def _floating(rewards: Tensor) -> Tensor:
    """rewards [groups, samples] as a floating tensor (integer rewards are accepted)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
    return rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())


def _flat_groups(rewards: Tensor) -> Tensor:
    """Groups whose rewards are all equal: rewards [groups, samples] -> [groups, 1] bool."""
    return (rewards == rewards[:, :1]).all(dim=1, keepdim=True)


def _centred(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """r - mean_g, exactly 0 on all-equal groups, and the mask of those groups.

    rewards: [groups, samples] -> (centred [groups, samples], flat [groups, 1] bool)
    """
    rewards = _floating(rewards)
    flat = _flat_groups(rewards)  # [groups, 1]
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # [groups, samples]
    return torch.where(flat, torch.zeros_like(centred), centred), flat


def _batch_std(values: Tensor) -> Tensor:
    """Population std over every element of values [groups, samples] -> scalar."""
    return (values - values.mean()).pow(2).mean().sqrt()


def grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: A = (r - mean_g) / (std_g + eps), std_g the population std (unbiased=False).

    rewards: [groups, samples] -> advantages [groups, samples]; all-equal groups give exact zeros.
    """
    centred, flat = _centred(rewards)  # [groups, samples], [groups, 1]
    std = centred.pow(2).mean(dim=1, keepdim=True).sqrt()  # [groups, 1], population std
    advantages = centred / (std + eps)  # [groups, samples]; 0 / 0 on flat groups when eps is 0
    return torch.where(flat, torch.zeros_like(advantages), advantages)


def drgrpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """Dr. GRPO: A = r - mean_g (no division by the std; eps is unused, kept for one signature).

    rewards: [groups, samples] -> advantages [groups, samples]; all-equal groups give exact zeros.
    """
    del eps  # the registry passes it to every estimator; this one has nothing to divide
    return _centred(rewards)[0]


def rloo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """RLOO: A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_g) (eps unused).

    rewards: [groups, samples] -> advantages [groups, samples]; all-equal groups, and so every group of
    one response (no other response to compare with), give exact zeros.
    """
    del eps
    centred, _ = _centred(rewards)  # [groups, samples]
    n = centred.shape[1]
    return centred * (n / (n - 1)) if n > 1 else torch.zeros_like(centred)


def reinforce_pp_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++: the rewards whitened over the whole batch, A = (r - mean_B) / (std_B + eps).

    rewards: [groups, samples] -> advantages [groups, samples]; no group baseline, so an all-equal group
    is zero only when the whole batch is (then exactly).
    """
    rewards = _floating(rewards)
    if bool((rewards == rewards.flatten()[0]).all()):
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (_batch_std(rewards) + eps)


def reinforce_pp_baseline_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline: the group mean subtracted, then scaled to unit std over the batch.

    rewards: [groups, samples] -> advantages [groups, samples]:
    c = r - mean_g;  A = c / (std_B(c) + eps). mean_B(c) = 0 in exact arithmetic (equal group sizes), so it
    is not subtracted; all-equal groups give exact zeros.
    """
    centred, flat = _centred(rewards)  # [groups, samples], [groups, 1]
    advantages = centred / (_batch_std(centred) + eps)  # [groups, samples]; 0 / 0 when every group is flat, eps 0
    return torch.where(flat, torch.zeros_like(advantages), advantages)


def gae_rewards(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """gae: the rewards as they are (eps unused). PPO's GAE advantages are per token, from these rewards and the
    critic's values, and are computed where the values are, by the loss (`workers.training.gae.GaeTerm`).

    rewards: [groups, samples] -> [groups, samples], the same values as floats.
    """
    del eps
    return _floating(rewards)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
    "gae": gae_rewards,
}
# Estimators whose all-equal groups are exact zeros; batch whitening keeps them so.
_GROUP_BASELINED = frozenset({"grpo", "drgrpo", "rloo", "reinforce_pp_baseline"})


def whiten(advantages: Tensor, eps: float = 1e-6) -> Tensor:
    """Batch whitening: (A - mean_B) / (std_B + eps) over every element. advantages: [groups, samples]."""
    return (advantages - advantages.mean()) / (_batch_std(advantages) + eps)


def group_advantages(
    rewards: Tensor, mode: str = "grpo", eps: float = 1e-6, whitened: bool = False, valid: Tensor | None = None
) -> Tensor:
    """Advantages of every response by the estimator named `mode`, optionally whitened over the batch.

    rewards: [groups, samples] -> advantages [groups, samples]. See the module docstring for the formulas.
    `valid` [groups, samples] bool marks the responses whose reward exists (a reward function or an episode's
    environment that failed has none): the others get advantage 0 and every statistic is taken as if they were
    not sampled (`excluding`).
    """
    try:
        estimator = ADVANTAGE_ESTIMATORS[mode]
    except KeyError:
        raise ValueError(f"unknown advantage mode {mode!r}; valid: {sorted(ADVANTAGE_ESTIMATORS)}") from None
    if valid is not None and not bool(valid.all()):
        return excluding(_floating(rewards), valid, mode, eps, whitened)
    advantages = estimator(rewards, eps)  # [groups, samples]
    if not whitened:
        return advantages
    out = whiten(advantages, eps)
    if bool((advantages == 0).all()):  # nothing to whiten (and 0 / 0 when eps is 0)
        return advantages
    if mode in _GROUP_BASELINED:
        out = torch.where(_flat_groups(_floating(rewards)), torch.zeros_like(out), out)
    return out


def excluding(rewards: Tensor, valid: Tensor, mode: str, eps: float, whitened: bool) -> Tensor:
    """Advantages with the invalid responses left out: each group's estimator over its valid responses only (a group
    of k valid ones is a group of k), batch statistics over the valid responses of the batch; 0 where invalid.

    rewards, valid: [groups, samples] -> advantages [groups, samples].
    """
    out = torch.zeros_like(rewards)  # [groups, samples]
    if not bool(valid.any()):
        return out
    if mode == "reinforce_pp":  # batch statistics only: the valid responses as one group
        out[valid] = reinforce_pp_advantages(rewards[valid].unsqueeze(0), eps).squeeze(0)
    else:
        group_mode = "drgrpo" if mode == "reinforce_pp_baseline" else mode
        for g in range(rewards.shape[0]):
            keep = valid[g]
            if bool(keep.any()):
                out[g, keep] = group_advantages(rewards[g, keep].unsqueeze(0), group_mode, eps).squeeze(0)
        if mode == "reinforce_pp_baseline":  # centred per group, scaled by the batch std of the centred values
            out[valid] = out[valid] / (_batch_std(out[valid].unsqueeze(0)) + eps)
    if whitened and not bool((out[valid] == 0).all()):
        white = whiten(out[valid].unsqueeze(0), eps).squeeze(0)
        if mode in _GROUP_BASELINED:  # all-equal groups keep their exact zeros
            white = torch.where(_flat_valid(rewards, valid)[valid], torch.zeros_like(white), white)
        out[valid] = white
    return out


def _flat_valid(rewards: Tensor, valid: Tensor) -> Tensor:
    """[groups, samples] bool: the responses of groups whose valid rewards are all equal."""
    flat = torch.zeros_like(valid)
    for g in range(rewards.shape[0]):
        kept = rewards[g, valid[g]]
        flat[g] = bool((kept == kept[0]).all()) if kept.numel() else True
    return flat


def overlong_penalty(response_lengths: Tensor, max_tokens: int, window: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, to be added to the rewards: 0 up to the window, then linear, then -penalty.

    response_lengths: [groups, samples] (any shape) -> penalty terms of the same shape, <= 0:
        L <= max_tokens - window              0
        max_tokens - window < L <= max_tokens  -penalty * (L - (max_tokens - window)) / window
        L > max_tokens                        -penalty
    A response of exactly `max_tokens` tokens gets the full -penalty (usually it was cut off there).
    """
    if not 0 < window <= max_tokens:
        raise ValueError(f"overlong window ({window}) must be in 1..max_tokens ({max_tokens})")
    lengths = response_lengths.to(torch.get_default_dtype())
    start = max_tokens - window
    return -penalty * ((lengths - start) / window).clamp(0.0, 1.0)


def shaped_rewards(batch: Batch, overlong: OverlongConfig | None) -> tuple[Tensor, dict[str, float]]:
    """The rewards the advantages are computed from ([B, n]): the batch's, plus `overlong_penalty` of each response's
    length when `trainer.overlong` is set; and the shaping's metrics (none when off)."""
    if overlong is None:
        return batch.rewards, {}
    lengths = torch.tensor(
        [n - p for n, p in zip(batch.lengths, batch.prompt_lengths, strict=True)], dtype=batch.rewards.dtype
    ).reshape(batch.rewards.shape)  # [B, n] response tokens, rows in group order
    penalty = overlong_penalty(lengths, overlong.max_tokens, overlong.window, overlong.penalty)  # [B, n]
    shaped = {"overlong_penalty_mean": float(penalty.mean()), "overlong_frac": float((penalty < 0).float().mean())}
    return batch.rewards + penalty, shaped

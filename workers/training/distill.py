"""On-policy distillation: the teacher's log-probs of the student's own samples as a per-token advantage.

Shapes: B sequences, T response tokens (right-padded), as in `workers.training.losses`.

    d_t = log p_teacher(y_t) - log p_sampling(y_t)                                        # [B, T]
    A_t = coef * d_t + reward_coef * A_b                                                  # [B, T]

`p_sampling` is the policy that drew the token (the rollout engine's log-prob), so the advantage of a stale sample is
still the reverse KL of the policy that sampled it; the gap to the policy being trained is the surrogate's ratio and
the off-policy correction's business, as for any advantage. `A_b` is the reward's advantage of the sequence
(`workers.training.advantages`), 0-weighted by default: pure distillation.

Why this is reverse KL: E_{y ~ pi}[sum_t log pi(y_t) - log p_teacher(y_t)] = KL(pi || p_teacher) over sequences, and
the policy gradient with the per-token reward d_t and no discount (each token credited with its own term only) is a
gradient of -KL with the future terms dropped, as in GKD's on-policy variant (Agarwal et al., 2024) and the 2025
on-policy distillation write-ups (Qwen3; Thinking Machines). A KL penalty with the teacher as the reference is not
the same: k1's gradient is zero in expectation and k3's is the forward KL.

The reported `distill_reverse_kl` is the mean over trained tokens of log p_sampling - log p_teacher (a Monte-Carlo
estimate of the per-token reverse KL of the sampling policy), computed before the update.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from workers.training.losses import check_shapes, masked, masked_mean


def distill_advantages(
    seq_adv: Tensor, teacher_logp: Tensor, sampling_logp: Tensor, mask: Tensor, coef: float, reward_coef: float
) -> Tensor:
    """A_t = coef * (teacher_logp - sampling_logp) + reward_coef * seq_adv, 0 where mask is 0.

    seq_adv: [B]; teacher_logp, sampling_logp, mask: [B, T] -> [B, T]. Padding may hold any value.
    """
    check_shapes(mask, teacher_logp=teacher_logp, sampling_logp=sampling_logp)
    if seq_adv.shape != mask.shape[:1]:
        raise ValueError(f"seq_adv must be [B] = [{mask.shape[0]}], got {list(seq_adv.shape)}")
    valid = mask.bool()
    gap = masked(teacher_logp, valid) - masked(sampling_logp, valid)  # [B, T]
    return masked(coef * gap + reward_coef * seq_adv.unsqueeze(1), valid)


def reverse_kl(teacher_logp: Tensor, sampling_logp: Tensor, mask: Tensor) -> float:
    """Mean over valid tokens of sampling_logp - teacher_logp: [B, T] each -> float (0.0 without a valid token)."""
    check_shapes(mask, teacher_logp=teacher_logp, sampling_logp=sampling_logp)
    valid = mask.bool()
    return masked_mean(masked(sampling_logp, valid) - masked(teacher_logp, valid), valid)


class Advantages(Protocol):
    """What the trainer's loss takes as its advantages: a micro-batch's sequence advantages [B] in (with the
    critic's values [B, T] and the rows' rewards [B] in a run with a critic), the advantages of its tokens ([B] or
    [B, T]) and metrics out."""

    def __call__(
        self,
        seq_adv: Tensor,
        teacher_logp: Tensor | None,
        sampling_logp: Tensor,
        mask: Tensor,
        values: Tensor | None = None,
        rewards: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]: ...


class DistillTerm:
    """The teacher's per-token advantage (`coef`) beside the reward's (`reward_coef`), for a run with a teacher;
    a run without one uses `reward_advantages` (chosen once, when the trainer is built)."""

    def __init__(self, coef: float, reward_coef: float) -> None:
        self.coef, self.reward_coef = coef, reward_coef

    def __call__(
        self,
        seq_adv: Tensor,
        teacher_logp: Tensor | None,
        sampling_logp: Tensor,
        mask: Tensor,
        values: Tensor | None = None,
        rewards: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        if teacher_logp is None:
            raise ValueError("a run with a teacher got a batch without the teacher's log-probs")
        with torch.no_grad():
            adv = distill_advantages(seq_adv, teacher_logp, sampling_logp, mask, self.coef, self.reward_coef)
            metrics = {"distill_reverse_kl": reverse_kl(teacher_logp, sampling_logp, mask)}
        return adv, metrics


def reward_advantages(
    seq_adv: Tensor,
    teacher_logp: Tensor | None,
    sampling_logp: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    rewards: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """No teacher: the reward's sequence advantages as they are."""
    return seq_adv, {}

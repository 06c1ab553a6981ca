"""On-policy distillation: the teacher's log-probs of the student's own samples as a per-token advantage.

Shapes: B sequences, T response tokens (right-padded), as in `workers.training.losses`.

    d_t = log p_teacher(y_t) - log p_sampling(y_t)                                        # [B, T]
    b_t = mean of d_t over the other samples of the group with a token at t (0 if none)   # [B, T]  (baseline: group)
    A_t = coef * (d_t - b_t) + reward_coef * A_b                                          # [B, T]

`p_sampling` is the policy that drew the token (the rollout engine's log-prob), so the advantage of a stale sample is
still the reverse KL of the policy that sampled it; the gap to the policy being trained is the surrogate's ratio and
the off-policy correction's business, as for any advantage. `A_b` is the reward's advantage of the sequence
(`workers.training.advantages`), 0-weighted by default: pure distillation.

Why this is reverse KL: E_{y ~ pi}[sum_t log pi(y_t) - log p_teacher(y_t)] = KL(pi || p_teacher) over sequences, and
the policy gradient with the per-token reward d_t and no discount (each token credited with its own term only) is a
gradient of -KL with the future terms dropped, as in GKD's on-policy variant (Agarwal et al., 2024) and the 2025
on-policy distillation write-ups (Qwen3; Thinking Machines). A KL penalty with the teacher as the reference is not
the same: k1's gradient is zero in expectation and k3's is the forward KL.

How this deviates from the textbook estimator, and why: plain per-token REINFORCE on d_t (`baseline: none`) has no
baseline, and d_t is large and mostly negative where the student is far from the teacher: on the demo's noisy start a
wrong digit the teacher rules out has d ~ -8 to -15, the right one d ~ +2, and the mean per-token reverse KL is ~2.4.
Every sampled token is pushed down, the right digit gains mainly through the softmax's normalisation, and the
gradient is mostly noise (its norm stayed above the clip at every step, 3.4-4.6). Adam divides each step by the
gradient's running RMS, so noise shrinks the step along the signal: OPD reached 0.73-0.78 sampled accuracy in 200
steps where the target was 0.8. `b_t` is a control variate: the other samples of the group answer the same prompt
and are drawn independently of sample i, so E[b_t grad log pi(y_t)] = 0 and the gradient stays unbiased, while
d_t - b_t is centred: a right digit among wrong ones gets ~ +10, a wrong one ~ -1. At the first response token,
where the group shares its prefix, b_t estimates -KL(pi || p_teacher) there, the optimal constant baseline; later
positions have different prefixes and the baseline is only a cruder (still unbiased) one. It is computed once per
step over the whole batch (`distill_term` is called by the trainer's `step`), so it does not depend on how the
batch is cut into micro-batches or ranks. Benchmarks (docs/benchmarks.md, *Learning signals*) have the figures.

The reported `distill_reverse_kl` is the mean over trained tokens of log p_sampling - log p_teacher (a Monte-Carlo
estimate of the per-token reverse KL of the sampling policy), computed before the update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from workers.training.losses import check_shapes, masked, masked_mean


def group_baseline(values: Tensor, mask: Tensor, group_of: Sequence[int]) -> Tensor:
    """Leave-one-out mean per group and position: b[i, t] = mean of values[j, t] over the rows j != i of i's group
    with mask[j, t] = 1; 0 where there is none (and where mask[i, t] is 0).

    values, mask: [B, T]; group_of: [B] (any ids, rows of a group need not be adjacent) -> [B, T].
    """
    check_shapes(mask, values=values)
    if len(group_of) != mask.shape[0]:
        raise ValueError(f"group_of must name the group of each of the {mask.shape[0]} rows, got {len(group_of)}")
    valid = mask.bool()
    x = masked(values, valid).double()  # [B, T]
    counted = valid.double()  # [B, T]
    ids = torch.unique(torch.as_tensor(list(group_of)), return_inverse=True)[1]  # [B], 0..G-1
    size = (int(ids.max()) + 1 if len(group_of) else 0, mask.shape[1])
    sums = torch.zeros(size, dtype=x.dtype).index_add_(0, ids, x)  # [G, T]
    counts = torch.zeros(size, dtype=x.dtype).index_add_(0, ids, counted)  # [G, T]
    others = counts[ids] - counted  # [B, T]
    mean = (sums[ids] - x) / others.clamp(min=1)  # [B, T]
    return masked(torch.where(others > 0, mean, torch.zeros_like(mean)), valid).to(values.dtype)


def distill_advantages(
    seq_adv: Tensor,
    teacher_logp: Tensor,
    sampling_logp: Tensor,
    mask: Tensor,
    coef: float,
    reward_coef: float,
    group_of: Sequence[int] | None = None,
) -> Tensor:
    """A_t = coef * (d_t - b_t) + reward_coef * seq_adv, d_t = teacher_logp - sampling_logp, 0 where mask is 0.

    b_t = `group_baseline(d, mask, group_of)`; without `group_of`, b_t = 0 (plain per-token REINFORCE).
    seq_adv: [B]; teacher_logp, sampling_logp, mask: [B, T]; group_of: [B] -> [B, T]. Padding may hold any value.
    """
    check_shapes(mask, teacher_logp=teacher_logp, sampling_logp=sampling_logp)
    if seq_adv.shape != mask.shape[:1]:
        raise ValueError(f"seq_adv must be [B] = [{mask.shape[0]}], got {list(seq_adv.shape)}")
    valid = mask.bool()
    gap = masked(teacher_logp, valid) - masked(sampling_logp, valid)  # [B, T]
    if group_of is not None:
        gap = gap - group_baseline(gap, mask, group_of)
    return masked(coef * gap + reward_coef * seq_adv.unsqueeze(1), valid)


def reverse_kl(teacher_logp: Tensor, sampling_logp: Tensor, mask: Tensor) -> float:
    """Mean over valid tokens of sampling_logp - teacher_logp: [B, T] each -> float (0.0 without a valid token)."""
    check_shapes(mask, teacher_logp=teacher_logp, sampling_logp=sampling_logp)
    valid = mask.bool()
    return masked_mean(masked(sampling_logp, valid) - masked(teacher_logp, valid), valid)


@dataclass(frozen=True)
class StepTokens:
    """What a per-token advantage reads of a step's batch (`workers.training.batch.Batch`): tensors [N, T] laid out
    as its mask, and the group of each row."""

    sampling_logp: Tensor
    mask: Tensor
    group_of: Sequence[int]
    teacher_logp: Tensor | None = None
    """The teacher's log-probs (a run with a teacher)."""
    values: Tensor | None = None
    """The critic's values (a run with a critic)."""


class Advantages(Protocol):
    """What the trainer's loss takes as its advantages: a step's sequence advantages [N] (under `gae`, the rows'
    rewards) and its tokens in; the advantages of its tokens ([N] or [N, T]) and metrics out."""

    def __call__(self, seq_adv: Tensor, tokens: StepTokens) -> tuple[Tensor, dict[str, float]]: ...


class DistillTerm:
    """The teacher's per-token advantage (`coef`, with the group baseline unless `baseline` is "none") beside the
    reward's (`reward_coef`), for a run with a teacher; a run without one uses `reward_advantages` (chosen once,
    when the trainer is built)."""

    def __init__(self, coef: float, reward_coef: float, baseline: str = "group") -> None:
        if baseline not in ("group", "none"):
            raise ValueError(f"unknown baseline {baseline!r}; valid: group, none")
        self.coef, self.reward_coef, self.baseline = coef, reward_coef, baseline

    def __call__(self, seq_adv: Tensor, tokens: StepTokens) -> tuple[Tensor, dict[str, float]]:
        teacher, sampling, mask = tokens.teacher_logp, tokens.sampling_logp, tokens.mask
        if teacher is None:
            raise ValueError("a run with a teacher got a batch without the teacher's log-probs")
        groups = tokens.group_of if self.baseline == "group" else None
        with torch.no_grad():
            adv = distill_advantages(seq_adv, teacher, sampling, mask, self.coef, self.reward_coef, groups)
            metrics = {"distill_reverse_kl": reverse_kl(teacher, sampling, mask)}
        return adv, metrics


def reward_advantages(seq_adv: Tensor, tokens: StepTokens) -> tuple[Tensor, dict[str, float]]:
    """No teacher: the reward's sequence advantages as they are."""
    return seq_adv, {}

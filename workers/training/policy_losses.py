"""The actor's policy-gradient surrogates, a registry keyed by `trainer.loss.type`, and `policy_loss`, which
composes one with an off-policy correction and aggregates it.

Shapes: B sequences (responses) in the batch, T response tokens (right-padded).

    logp      log pi_theta(y_t)   the policy being trained, carries the gradient        # [B, T]
    logp_old  log pi_old(y_t)     the trainer's own forward at the start of the step    # [B, T]
    A         one advantage per sequence, broadcast over its tokens                     # [B] -> [B, 1]
              or one per token (on-policy distillation, `workers.training.distill`)      # [B, T]
    r         exp(logp - logp_old) per token                                            # [B, T]
    clip(x)   clamp(x, 1 - clip_low, 1 + clip_high)              (clip-higher, DAPO: 0.2 / 0.28)
    w         the correction's detached weight (`workers.training.corrections`)          # [B, T]

    ppo        loss_t = -min(r A, clip(r) A)
    dual_clip  loss_t = -max(min(r A, clip(r) A), c A)  where A < 0;  as ppo where A >= 0   (c > 1)
    gspo       s_b = exp(mean_t (logp - logp_old)) over b's valid tokens;  loss_t = -min(s_b A, clip(s_b) A)
    cispo      loss_t = -sg(clip(r)) A (1 + logp - sg(logp))   value -clip(r) A, gradient -clip(r) A grad logp

    loss = aggregate(w * loss_t, mask, aggregation, normalizer)        ("token" or "sequence")

How this deviates from the papers:

- Decoupled PPO (Hilton et al., 2022; AReaL): the trust region is anchored on the trainer's old
  log-probs, not on the behaviour policy; the gap to the behaviour policy is the correction's w.
- Dual-clip (Ye et al., 2020) bounds the loss of a negative-advantage token at -c A once its ratio is
  far above 1, where plain PPO's loss grows without bound; such a token has no gradient.
- GSPO (Zheng et al., 2025): one length-normalised ratio per sequence, its gradient spread over the
  sequence's tokens (d s_b / d logp_t = s_b / n_b). The paper averages over sequences, which is
  `aggregation: sequence`; with `token` (the default) a sequence weighs by its length. The paper's clip
  range is tiny (3e-4 / 4e-4): set `trainer.loss.clip_low` / `clip_high` for it.
- CISPO (MiniMax-M1, 2025) clips the detached IS weight instead of the update, so every token keeps a
  gradient. The paper writes the objective as sg(clip(r)) A log pi; adding the constant 1 - sg(logp)
  leaves the gradient the same and makes the loss value -clip(r) A, comparable with the other losses.
  The paper bounds only the upper side (a very large eps_low); here both `clip_low` and `clip_high` apply.

Only `logp` carries a gradient: logp_old, logp_rollout and the advantages are detached here. Masked
positions are zeroed before any arithmetic, so padding may hold any value, even inf or nan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from workers.training.corrections import correction_weights
from workers.training.losses import AGGREGATIONS, aggregate, check_shapes, masked, masked_mean, sequence_mean

if TYPE_CHECKING:
    from workers.config.trainer import TrainerConfig

# (logp, logp_old, A [B, 1|T], valid, clip_low, clip_high, **options) -> (loss_t, clip_active, ratio), all [B, T]
SurrogateLoss = Callable[..., tuple[Tensor, Tensor, Tensor]]
LOSS_METRICS = ("ppo_clip_frac", "ratio_mean", "policy/neg_logprob_mean")


def _log_ratio(logp: Tensor, logp_old: Tensor, valid: Tensor) -> Tensor:
    """logp - logp_old with logp_old detached, 0 on padding: [B, T]."""
    return masked(logp, valid) - masked(logp_old.detach(), valid)


def _clipped_surrogate(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """min(r A, clip(r) A) and where the clipped branch is the smaller (no gradient). ratio [B, T], adv [B, 1|T]."""
    unclipped = ratio * adv  # [B, T]
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv  # [B, T]
    clip_active = clipped < unclipped  # [B, T]; ties keep the unclipped branch and its gradient
    return torch.where(clip_active, clipped, unclipped), clip_active


def ppo_loss(
    logp: Tensor, logp_old: Tensor, adv: Tensor, valid: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """ppo: loss_t = -min(r A, clip(r) A), r = exp(logp - logp_old). [B, T], A [B, 1|T] -> (loss_t, clip_active, r)."""
    ratio = _log_ratio(logp, logp_old, valid).exp()  # [B, T]
    surrogate, clip_active = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    return -surrogate, clip_active, ratio


def dual_clip_loss(
    logp: Tensor, logp_old: Tensor, adv: Tensor, valid: Tensor, clip_low: float, clip_high: float, c: float = 3.0
) -> tuple[Tensor, Tensor, Tensor]:
    """dual_clip: loss_t = -max(min(r A, clip(r) A), c A) where A < 0, ppo's elsewhere; c > 1.

    logp, logp_old, valid: [B, T]; adv: [B, 1|T] -> (loss_t, clip_active, r), all [B, T]. A token held at
    the bound c A has no gradient and counts as clipped.
    """
    if c <= 1.0:
        raise ValueError(f"dual-clip c must be above 1, got {c}")
    ratio = _log_ratio(logp, logp_old, valid).exp()  # [B, T]
    surrogate, clip_active = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    bound = (c * adv).expand_as(surrogate)  # [B, T], a constant: no gradient
    dual = (adv < 0) & (surrogate < bound)  # [B, T]
    return -torch.where(dual, bound, surrogate), clip_active | dual, ratio


def gspo_loss(
    logp: Tensor, logp_old: Tensor, adv: Tensor, valid: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """gspo: s_b = exp(mean_t (logp - logp_old)) over b's valid tokens; loss_t = -min(s_b A, clip(s_b) A).

    logp, logp_old, valid: [B, T]; adv: [B, 1|T] -> (loss_t, clip_active, s broadcast), all [B, T].
    """
    seq_ratio = sequence_mean(_log_ratio(logp, logp_old, valid), valid).exp()  # [B, 1]
    surrogate, clip_active = _clipped_surrogate(seq_ratio, adv, clip_low, clip_high)  # [B, 1]
    shape = logp.shape
    return -surrogate.expand(shape), clip_active.expand(shape), seq_ratio.expand(shape)


def cispo_loss(
    logp: Tensor, logp_old: Tensor, adv: Tensor, valid: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """cispo: loss_t = -sg(clip(r)) A (1 + logp - sg(logp)): value -clip(r) A, gradient -clip(r) A grad logp.

    logp, logp_old, valid: [B, T]; adv: [B, 1|T] -> (loss_t, clip_active = r outside the clip range, r), all [B, T].
    """
    live = masked(logp, valid)  # [B, T]
    ratio = (live.detach() - masked(logp_old.detach(), valid)).exp()  # [B, T], detached
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    clip_active = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)  # [B, T]
    return -weight * adv * (1.0 + live - live.detach()), clip_active, ratio


POLICY_LOSSES: dict[str, SurrogateLoss] = {
    "ppo": ppo_loss,
    "dual_clip": dual_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}


@dataclass(frozen=True)
class LossSettings:
    """What shapes the policy loss, taken once from the trainer's config (`LossSettings.of`)."""

    loss: str = "ppo"
    """The surrogate: a key of POLICY_LOSSES."""
    clip_low: float = 0.2
    """The ratio's clip range is [1 - clip_low, 1 + clip_high]."""
    clip_high: float = 0.28
    """See clip_low (clip-higher, DAPO)."""
    aggregation: str = "token"
    """How per-token losses reduce to one: "token" or "sequence" (`workers.training.losses.aggregate`)."""
    correction: str = "tis"
    """The off-policy correction: a key of `workers.training.corrections.CORRECTIONS`."""
    loss_options: Mapping[str, Any] = field(default_factory=dict)
    """The surrogate's own parameters (dual_clip's `c`)."""
    correction_options: Mapping[str, Any] = field(default_factory=dict)
    """The correction's own parameters (its `low` / `high`)."""

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; valid: {list(AGGREGATIONS)}")
        if self.loss not in POLICY_LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; valid: {sorted(POLICY_LOSSES)}")

    @classmethod
    def of(cls, cfg: TrainerConfig) -> LossSettings:
        """The settings of `trainer.loss`, `trainer.correction`, the clip range and the aggregation."""
        return cls(
            loss=cfg.loss.type,
            clip_low=cfg.loss.clip_low,
            clip_high=cfg.loss.clip_high,
            aggregation=cfg.aggregation,
            correction=cfg.correction.type,
            loss_options=cfg.loss.options(),
            correction_options=cfg.correction_options(),
        )


DEFAULT_SETTINGS = LossSettings()
"""ppo, clip [0.8, 1.28], token aggregation, tis with its default bounds."""


def policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    logp_rollout: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: LossSettings = DEFAULT_SETTINGS,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The surrogate `settings.loss`, reweighted by the correction `settings.correction`, aggregated.

    logp, logp_old, logp_rollout, mask: [B, T]; advantages: [B] (per sequence) or [B, T] (per token) ->
    (loss scalar, metrics).
    w = correction(logp_old, logp_rollout)         # [B, T] detached (tis: clip(exp(logp_old - logp_rollout), 0, 2))
    loss = aggregate(w * loss_t, mask, aggregation, normalizer),  loss_t from POLICY_LOSSES[loss]
    `normalizer`: the denominator of a micro-batch's share of a larger batch (`aggregate`). Metrics, over valid
    tokens: ppo_clip_frac (tokens the loss clipped: no gradient for ppo / dual_clip / gspo, a clipped weight for
    cispo), ratio_mean, policy/neg_logprob_mean (mean of -logp: the sampled estimate of the policy's per-token
    entropy, E_{y~pi}[-log pi(y)], from the sampled tokens alone; exact in expectation only where the samples come
    from pi itself, i.e. on-policy at the rollout's temperature) and the correction's
    (`workers.training.corrections.CORRECTION_METRICS`).
    """
    s = settings
    check_shapes(mask, logp=logp, logp_old=logp_old, logp_rollout=logp_rollout)
    if advantages.shape not in (mask.shape[:1], mask.shape):
        raise ValueError(
            f"advantages must be [B] = [{mask.shape[0]}] or [B, T] = {list(mask.shape)}, got {list(advantages.shape)}"
        )
    valid = mask.bool()
    adv = advantages.detach().to(logp.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else masked(adv, valid)  # [B, 1] or [B, T], 0 on padding
    surrogate = POLICY_LOSSES[s.loss]
    loss_t, clip_active, ratio = surrogate(logp, logp_old, adv, valid, s.clip_low, s.clip_high, **s.loss_options)
    w, metrics = correction_weights(logp_old, logp_rollout, mask, s.correction, **s.correction_options)
    total = aggregate(w * loss_t, mask, s.aggregation, normalizer)
    with torch.no_grad():
        metrics = {
            "ppo_clip_frac": masked_mean(clip_active.to(ratio.dtype), valid),
            "ratio_mean": masked_mean(ratio, valid),
            "policy/neg_logprob_mean": masked_mean(-logp.detach().float(), valid),
            **metrics,
        }
    return total, metrics

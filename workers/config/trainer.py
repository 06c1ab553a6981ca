"""The trainer section: optimisation, the algorithm plug-ins (advantage estimator, loss, off-policy correction;
one model per type, docs/algorithms.md), overlong shaping, warm-up, supervised rows mixed into RL, simulation."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from workers.config.base import Section, shorthand
from workers.config.trainer_sections import (
    CheckpointConfig,
    ComputeConfig,
    DistributedConfig,
    KlConfig,
    LoraConfig,
    MoeConfig,
    OptimConfig,
    ScheduleConfig,
    SftConfig,
)


class _Advantage(Section):
    """What every advantage estimator takes."""

    whiten: bool = False
    """Whiten the advantages over the step's batch, (A - mean) / (std + eps); all-equal groups stay exact zeros."""
    eps: float = Field(default=1e-6, gt=0)
    """Added to the standard deviation an estimator or the whitening divides by."""


class GrpoAdvantage(_Advantage):
    """(r - mean) / (std + eps) per prompt group."""

    type: Literal["grpo"] = "grpo"


class DrGrpoAdvantage(_Advantage):
    """r - mean per prompt group (no division by the standard deviation)."""

    type: Literal["drgrpo"]


class RlooAdvantage(_Advantage):
    """r minus the mean of the group's other rewards (leave-one-out); a group of one gets 0."""

    type: Literal["rloo"]


class ReinforcePpAdvantage(_Advantage):
    """REINFORCE++: the rewards whitened over the step's batch (no group baseline)."""

    type: Literal["reinforce_pp"]


class ReinforcePpBaselineAdvantage(_Advantage):
    """REINFORCE++-baseline: r - group mean, divided by the batch's standard deviation of that."""

    type: Literal["reinforce_pp_baseline"]


class GaeAdvantage(Section):
    """PPO's GAE per token from the reward and the critic's values (a run with a `critic` section, whose gamma and
    lam it uses; `workers.training.gae`)."""

    type: Literal["gae"]


AdvantageConfig = Annotated[
    GrpoAdvantage
    | DrGrpoAdvantage
    | RlooAdvantage
    | ReinforcePpAdvantage
    | ReinforcePpBaselineAdvantage
    | GaeAdvantage,
    Field(discriminator="type"),
    BeforeValidator(shorthand),
]


class _Loss(Section):
    """What every policy loss shares: the ratio's clip range; its own options are the loss function's keyword
    parameters."""

    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """Ratio clip below 1 (the range is [1 - clip_low, 1 + clip_high]). It binds only from the second optimizer
    update on a step's sequences (mini_batches or ppo_epochs above 1); with one update the ratio is 1."""
    clip_high: float = Field(default=0.28, ge=0)
    """Ratio clip above 1 (clip-higher); binds like `clip_low`."""

    def options(self) -> dict[str, Any]:
        """The loss function's own keyword parameters (`workers.training.policy_losses.POLICY_LOSSES`), besides
        the clip range."""
        return self.model_dump(exclude={"type", "clip_low", "clip_high"})


class PpoLoss(_Loss):
    """PPO clipped surrogate per token, clip range [1 - clip_low, 1 + clip_high]."""

    type: Literal["ppo"] = "ppo"


class DualClipLoss(_Loss):
    """PPO with a second bound: a negative-advantage token's loss is at most -c * A."""

    type: Literal["dual_clip"]
    c: float = Field(default=3.0, gt=1)
    """The dual-clip constant; above 1."""


class GspoLoss(_Loss):
    """GSPO: one length-normalised ratio per sequence, clipped, applied to all its tokens."""

    type: Literal["gspo"]


class CispoLoss(_Loss):
    """CISPO: the clipped, detached IS weight times A times log pi; every token keeps a gradient."""

    type: Literal["cispo"]


LossConfig = Annotated[
    PpoLoss | DualClipLoss | GspoLoss | CispoLoss, Field(discriminator="type"), BeforeValidator(shorthand)
]


class _BoundedCorrection(Section):
    """A correction with a [low, high] range of the importance weight."""

    low: float = Field(default=0.0, ge=0)
    """Lower bound of the weight."""
    high: float = Field(default=2.0, gt=0)
    """Upper bound of the weight."""

    @model_validator(mode="after")
    def _ordered(self) -> _BoundedCorrection:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


class IcepopCorrection(_BoundedCorrection):
    """IcePop: tokens whose exp(logp_old - logp_rollout) is outside [low, high] are masked out of the loss."""

    type: Literal["icepop"]
    low: float = Field(default=0.5, ge=0)
    """Tokens with a weight below this are masked out."""
    high: float = Field(default=5.0, gt=0)
    """Tokens with a weight above this are masked out."""


class TisCorrection(_BoundedCorrection):
    """Truncated importance sampling: w = clip(exp(logp_old - logp_rollout), low, high) per token."""

    type: Literal["tis"] = "tis"


class SeqIsCorrection(_BoundedCorrection):
    """One weight per sequence: the geometric mean of its token weights, clipped to [low, high]."""

    type: Literal["seq_is"]


class NoCorrection(Section):
    """No off-policy correction: every token weighs 1 (the mismatch is still reported)."""

    type: Literal["none"]


CorrectionConfig = Annotated[
    TisCorrection | IcepopCorrection | SeqIsCorrection | NoCorrection,
    Field(discriminator="type"),
    BeforeValidator(shorthand),
]


class OverlongConfig(Section):
    """DAPO's soft overlong punishment, added to the reward of responses that reach the last `window` tokens."""

    max_tokens: int = Field(ge=1)
    """The length at which the penalty is full (usually `rollout.max_new_tokens`)."""
    window: int = Field(ge=1)
    """Tokens before `max_tokens` over which the penalty grows linearly from 0 to `penalty`."""
    penalty: float = Field(default=1.0, ge=0)
    """The penalty at and beyond `max_tokens`, subtracted from the reward."""

    @model_validator(mode="after")
    def _window_fits(self) -> OverlongConfig:
        if self.window > self.max_tokens:
            raise ValueError(f"window ({self.window}) must not exceed max_tokens ({self.max_tokens})")
        return self


class WarmupConfig(Section):
    """Supervised warm-up on the task's answers before RL (a random model earns no reward)."""

    max_steps: int = Field(default=0, ge=0)
    """Upper bound of warm-up steps; 0 turns warm-up off."""
    target_accuracy: float = Field(default=0.2, ge=0, le=1)
    """Stop as soon as sampled accuracy on the task reaches this."""
    lr: float = Field(default=3e-3, gt=0)
    """Learning rate of the warm-up."""
    batch_size: int = Field(default=64, ge=1)
    """Examples per warm-up step."""
    check_every: int = Field(default=10, ge=1)
    """Steps between accuracy checks."""
    label_noise: float = Field(default=0.0, ge=0, lt=1)
    """Fraction of answers replaced by wrong ones in the `noise_steps` that follow (0: none)."""
    noise_steps: int = Field(default=0, ge=0)
    """Supervised steps with noisy labels after the clean warm-up."""


class SimTrainerConfig(Section):
    """A simulated optimizer step: the actor's loop, weight publishing and acks stay real, the update sleeps."""

    step_s: float = Field(default=0.0, ge=0)
    """Median time of one simulated optimizer step."""
    sigma: float = Field(default=0.0, ge=0, le=4)
    """Log-normal shape of the step time (0: every step takes `step_s`)."""
    seed: int | None = None
    """Seed of the step-time draws."""


MOVED: dict[str, str] = {
    "lr": "trainer.optim.lr",
    "weight_decay": "trainer.optim.weight_decay",
    "grad_clip": "trainer.optim.grad_clip",
    "lr_schedule": "trainer.schedule.kind",
    "lr_warmup_updates": "trainer.schedule.warmup_updates",
    "min_lr_ratio": "trainer.schedule.min_lr_ratio",
    "checkpoint_every": "trainer.checkpoint.every",
    "keep_checkpoints": "trainer.checkpoint.keep",
    "checkpoint_dir": "trainer.checkpoint.dir",
    "nproc": "trainer.distributed.nproc",
    "nnodes": "trainer.distributed.nnodes",
    "rdzv_endpoint": "trainer.distributed.rdzv_endpoint",
    "rdzv_id": "trainer.distributed.rdzv_id",
    "routing_replay": "trainer.moe.routing_replay",
    "routing_metrics_fraction": "trainer.moe.metrics_fraction",
    "device": "trainer.compute.device",
    "precision": "trainer.compute.precision",
    "micro_batch_tokens": "trainer.compute.micro_batch_tokens",
    "shared_prompt": "trainer.compute.shared_prompt",
    "activation_checkpointing": "trainer.compute.activation_checkpointing",
    "read_ahead": "trainer.compute.read_ahead",
    "kl_coef": "trainer.kl.coef",
    "kl_kind": "trainer.kl.kind",
    "clip_low": "trainer.loss: {type: ..., clip_low: ...}",
    "clip_high": "trainer.loss: {type: ..., clip_high: ...}",
    "tis_low": "trainer.correction: {type: tis, low: ...}",
    "tis_high": "trainer.correction: {type: tis, high: ...}",
}
"""The flat trainer keys of earlier configs and where each setting lives now; a config that sets one is refused
with that line (`relax_bus.settings.validation_problems` prints a `setting_removed` error as it is)."""


class TrainerConfig(Section):
    """The actor: the algorithm's keys (steps, batching, advantage, loss, correction, KL) at the top, the
    optimizer, schedule, checkpoints, ranks, compute and mixture-of-experts settings in their own sections."""

    steps: int = Field(default=100, ge=1)
    """Trainer steps of the run; each consumes `groups_per_step` groups and publishes one policy version."""
    mini_batches: int = Field(default=1, ge=1)
    """Optimizer updates per pass over a step's sequences (PPO mini-batches, each a contiguous slice)."""
    step_tries: int = Field(default=3, ge=1)
    """Tries of a step whose update raises (a batch the model cannot take) before its groups are dead-lettered with
    the error and the actor goes on with the next batch."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over a step's sequences. With mini_batches x ppo_epochs > 1 the old-policy log-probs are
    computed once before the first update, so the PPO ratio moves and its clip binds."""
    advantage: AdvantageConfig = Field(default_factory=GrpoAdvantage)
    """Advantage estimator: `grpo`, `drgrpo`, `rloo`, `reinforce_pp` or `reinforce_pp_baseline` (or
    `{type: grpo, eps: ..., whiten: true}`), or `gae` per token from a critic's values (needs a `critic` section)."""
    loss: LossConfig = Field(default_factory=PpoLoss)
    """Policy loss: `ppo`, `dual_clip` (`{type: dual_clip, c: 3.0}`), `gspo` or `cispo`; each clips the ratio to
    [1 - clip_low, 1 + clip_high] (`{type: ppo, clip_low: 0.2, clip_high: 0.28}`)."""
    correction: CorrectionConfig = Field(default_factory=lambda: IcepopCorrection(type="icepop"))
    """Off-policy correction against the rollout engine's log-probs: `icepop` (the default; docs/algorithms.md says
    why), `tis`, `seq_is` (each `{type: ..., low: ..., high: ...}`) or `none`."""
    aggregation: Literal["token", "sequence"] = "token"
    """Loss over tokens: token-level mean, or mean over sequences of their token means."""
    kl: KlConfig = Field(default_factory=KlConfig)
    """KL penalty to the reference policy (`{coef: ..., kind: ...}`)."""
    overlong: OverlongConfig | None = None
    """DAPO's overlong reward shaping (`{max_tokens: ..., window: ..., penalty: ...}`); null: off."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """The AdamW optimizer."""
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    """The learning-rate schedule."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """When and where checkpoints are written."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Trainer ranks and nodes (FSDP2 under torchrun)."""
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    """Device, precision and the memory/compute trade-offs of a step."""
    moe: MoeConfig = Field(default_factory=MoeConfig)
    """Mixture-of-experts policies: routing replay."""
    seed: int = 0
    """Seed of the trainer's own randomness (warm-up order)."""
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    """Supervised warm-up before RL."""
    sft: SftConfig | None = None
    """Supervised rows mixed into every optimizer update (`{dataset: ..., coef: ..., batch_size: ...}`); null: off."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter on the frozen base instead of every weight (`{rank: 8, alpha: 16, dropout: 0,
    target_modules: [q_proj, v_proj]}`); null: full fine-tuning."""
    simulate: SimTrainerConfig | None = None
    """Replace each optimizer update by a timed sleep (benchmarks of scheduling and the bus); the published
    weights then stay those the actor started with."""

    @model_validator(mode="wrap")
    @classmethod
    def _moved_keys(cls, data: Any, handler: ModelWrapValidatorHandler[TrainerConfig]) -> TrainerConfig:
        # A flat key of an earlier config gets one line naming its new place, listed with the section's other
        # problems (a pydantic "unknown setting" would not say where the setting went).
        if not isinstance(data, dict) or not (moved := [k for k in data if k in MOVED]):
            return handler(data)
        errors = [
            InitErrorDetails(
                type=PydanticCustomError(
                    "setting_removed", "{message}", {"message": f"trainer.{k} was removed: set {MOVED[k]}"}
                ),
                loc=(k,),
                input=data[k],
            )
            for k in moved
        ]
        try:
            handler({k: v for k, v in data.items() if k not in MOVED})
        except ValidationError as err:
            errors += [
                InitErrorDetails(type=e["type"], loc=e["loc"], input=e["input"], ctx=e.get("ctx", {}))  # type: ignore[typeddict-item]
                for e in err.errors()
            ]
        raise ValidationError.from_exception_data(cls.__name__, errors)

    def correction_options(self) -> dict[str, Any]:
        """The keyword parameters of the correction function (`workers.training.corrections.CORRECTIONS`)."""
        return self.correction.model_dump(exclude={"type"})

    @model_validator(mode="after")
    def _replay_fits(self) -> TrainerConfig:
        replay = self.moe.routing_replay
        if replay == "off":
            return self
        if self.compute.activation_checkpointing:
            raise ValueError(
                f"moe.routing_replay {replay} with compute.activation_checkpointing: the recomputed forward would "
                "replay the routing a second time; turn one of them off"
            )
        if self.distributed.world_size > 1:
            raise ValueError(
                f"moe.routing_replay {replay} runs in one trainer process: set distributed.nproc and nnodes to 1"
            )
        return self

    @model_validator(mode="after")
    def _lora_fits(self) -> TrainerConfig:
        if self.lora is not None and self.moe.routing_replay != "off":
            raise ValueError(
                f"trainer.lora with moe.routing_replay {self.moe.routing_replay}: routing replay trains every "
                "weight of the routers; turn one of them off"
            )
        return self

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates in one trainer step."""
        return self.mini_batches * self.ppo_epochs

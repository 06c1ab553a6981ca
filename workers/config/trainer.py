"""The trainer section: optimisation, the algorithm plug-ins (advantage estimator, loss, off-policy correction;
one model per type, docs/algorithms.md), overlong shaping, warm-up, simulation."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from workers.config.base import Section, shorthand


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


AdvantageConfig = Annotated[
    GrpoAdvantage | DrGrpoAdvantage | RlooAdvantage | ReinforcePpAdvantage | ReinforcePpBaselineAdvantage,
    Field(discriminator="type"),
    BeforeValidator(shorthand),
]


class _Loss(Section):
    """What every policy loss shares: its own options are the loss function's keyword parameters."""

    def options(self) -> dict[str, Any]:
        """The keyword parameters of the loss function (`workers.training.policy_losses.POLICY_LOSSES`)."""
        return self.model_dump(exclude={"type"})


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


class TisCorrection(Section):
    """Truncated importance sampling: w = clip(exp(logp_old - logp_rollout), low, high) per token."""

    type: Literal["tis"] = "tis"
    low: float | None = Field(default=None, ge=0)
    """Lower bound of the weight; null: `trainer.tis_low`."""
    high: float | None = Field(default=None, gt=0)
    """Upper bound (cap) of the weight; null: `trainer.tis_high`."""


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


class TrainerConfig(Section):
    """The actor: GRPO-family loss with off-policy correction."""

    steps: int = Field(default=100, ge=1)
    """Trainer steps of the run; each consumes `groups_per_step` groups and publishes one policy version."""
    lr: float = Field(default=5e-4, gt=0)
    """AdamW learning rate (the peak of the schedule)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule over the run's optimizer updates (steps x mini_batches x ppo_epochs)."""
    lr_warmup_updates: int = Field(default=0, ge=0)
    """Optimizer updates of linear lr warm-up from lr / lr_warmup_updates to lr."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Where `linear` and `cosine` end, as a fraction of lr."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay, on matrices only (never on norm scales and biases)."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient norm clip, applied before every optimizer update."""
    mini_batches: int = Field(default=1, ge=1)
    """Optimizer updates per pass over a step's sequences (PPO mini-batches, each a contiguous slice)."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over a step's sequences. With mini_batches x ppo_epochs > 1 the old-policy log-probs are
    computed once before the first update, so the PPO ratio moves and its clip binds."""
    micro_batch_tokens: int | None = Field(default=4096, ge=2)
    """Padded tokens (rows x longest sequence) per forward/backward; gradients accumulate over micro-batches
    and the loss is normalised as over the whole mini-batch. null: one pass over the mini-batch. Peak memory
    grows with it: SmolLM2-135M in fp32 on CPU peaks at ~6.7 GB at 2048, ~11.8 GB at 4096 (trainer_memory.py)."""
    shared_prompt: bool = True
    """Forward each distinct prompt of a micro-batch once and reuse its key/value cache for the group's responses
    (the plain pass's log-probs and gradients, with n times less prompt compute). Ignored under FSDP2
    (`nproc` > 1) and with `activation_checkpointing`, which take the plain pass."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer runs: `auto` takes the GPU (this rank's LOCAL_RANK under torchrun) when CUDA is present."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision: `auto` is bf16 on CUDA (fp32 master weights; FSDP2 reduces in fp32) and fp32 on CPU."""
    read_ahead: Literal["auto", "on", "off"] = "auto"
    """Fetch and decode the next step's train groups while a step trains, off the step's path. `auto`: on unless
    the update computes on the CPU, where the decoding takes the training's own cores (on 2 cores the demo's step
    took 7-10 % longer with it; `benchmarks/critical_path.py`); off, the rest of a step is still read as it
    arrives, beside the wait for it."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~30% more compute)."""
    routing_replay: Literal["off", "r2", "r3"] = "off"
    """Routing replay for mixture-of-experts policies (docs/r3.md): `r3` forces, in every training forward, the
    experts the rollout engine routed each token to (recorded by the torch engine, carried on the samples); `r2`
    records the trainer's own routing before a step's first update and forces it in the later updates (only
    matters with mini_batches x ppo_epochs > 1); `off` lets the routers choose."""
    routing_metrics_fraction: float = Field(default=0.125, ge=0, le=1)
    """With `r3`: the fraction of each micro-batch's rows (at least one) forwarded once more without replay in a
    step's first update, for `routing_mismatch_free`, the mismatch the trainer would have had without R3; 0 skips
    that forward (and the metric), which on tiny-moe costs about 10 % of a step (docs/r3.md)."""
    advantage: AdvantageConfig = Field(default_factory=GrpoAdvantage)
    """Advantage estimator: `grpo`, `drgrpo`, `rloo`, `reinforce_pp` or `reinforce_pp_baseline` (or
    `{type: grpo, eps: ..., whiten: true}`)."""
    loss: LossConfig = Field(default_factory=PpoLoss)
    """Policy loss: `ppo`, `dual_clip` (`{type: dual_clip, c: 3.0}`), `gspo` or `cispo`; all clip with
    `clip_low` / `clip_high`."""
    correction: CorrectionConfig = Field(default_factory=lambda: IcepopCorrection(type="icepop"))
    """Off-policy correction against the rollout engine's log-probs: `icepop` (the default; docs/algorithms.md says
    why), `tis` (bounds `tis_low` / `tis_high`; a config that sets those and no correction gets `tis`), `seq_is`
    (each `{type: ..., low: ..., high: ...}`) or `none`."""
    overlong: OverlongConfig | None = None
    """DAPO's overlong reward shaping (`{max_tokens: ..., window: ..., penalty: ...}`); null: off."""
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """PPO ratio clip below 1. It binds only from the second optimizer update on a step's sequences
    (mini_batches or ppo_epochs above 1); with one update the ratio is 1."""
    clip_high: float = Field(default=0.28, ge=0)
    """PPO ratio clip above 1 (clip-higher); binds like `clip_low`."""
    tis_low: float = Field(default=0.0, ge=0)
    """Lower bound of the truncated importance weight exp(logp_old - logp_rollout) of the `tis` correction."""
    tis_high: float = Field(default=2.0, gt=0)
    """Upper bound (cap) of the truncated importance weight of the `tis` correction."""
    aggregation: Literal["token", "sequence"] = "token"
    """Loss over tokens: token-level mean, or mean over sequences of their token means."""
    kl_coef: float = Field(default=0.0, ge=0)
    """KL penalty to the reference policy; above 0 puts the reference role in the chain."""
    kl_kind: Literal["k1", "k3", "low_var"] = "low_var"
    """KL estimator."""
    checkpoint_every: int = Field(default=10, ge=1)
    """Steps between checkpoints (model, optimizer, step, settled group ids, ack floor)."""
    keep_checkpoints: int = Field(default=5, ge=1)
    """Newest checkpoints kept besides step 0's; `relax replay` starts from one at or before the step."""
    checkpoint_dir: str | None = None
    """Directory for sharded checkpoints: every trainer rank writes its own shards (safetensors through
    torch.distributed.checkpoint, in the background) under `<checkpoint_dir>/<run>/ckpt-<step>`, and a restart
    on any number of ranks reads them back. Several nodes need a filesystem they all mount there. Null:
    each checkpoint is gathered on rank 0 and stored whole in the weights object store."""
    nproc: int = Field(default=1, ge=1)
    """Trainer processes; above 1 runs under torchrun with FSDP2."""
    nnodes: int = Field(default=1, ge=1)
    """Machines the trainer spans, each running `nproc` ranks (world size nnodes x nproc, FSDP2 across all);
    above 1 the nodes meet in torchrun's c10d rendezvous (docs/multinode.md)."""
    rdzv_endpoint: str | None = None
    """host:port of the c10d rendezvous store, on the first node and reachable from every other; null: `relax
    run` (one machine) picks 127.0.0.1 and a free port, and `relax worker actor` on several machines refuses."""
    rdzv_id: str | None = Field(default=None, min_length=1)
    """Rendezvous id every node of the trainer gives; null: the run id."""
    seed: int = 0
    """Seed of the trainer's own randomness (warm-up order)."""
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    """Supervised warm-up before RL."""
    simulate: SimTrainerConfig | None = None
    """Replace each optimizer update by a timed sleep (benchmarks of scheduling and the bus); the published
    weights then stay those the actor started with."""

    @model_validator(mode="after")
    def _tis_range(self) -> TrainerConfig:
        if self.tis_low >= self.tis_high:
            raise ValueError(f"tis_low ({self.tis_low}) must be below tis_high ({self.tis_high})")
        return self

    @model_validator(mode="before")
    @classmethod
    def _tis_bounds_name_tis(cls, data: Any) -> Any:
        # tis_low / tis_high are the `tis` correction's bounds: a config that sets them and names no correction
        # meant that correction (it was the default before icepop).
        if isinstance(data, dict) and "correction" not in data and ({"tis_low", "tis_high"} & data.keys()):
            data = {**data, "correction": {"type": "tis"}}
        return data

    @model_validator(mode="after")
    def _one_source_of_tis_bounds(self) -> TrainerConfig:
        # tis_low / tis_high at their defaults defer to correction.low / high; a dumped config (both given)
        # validates again unchanged.
        changed = [n for n, d in (("tis_low", 0.0), ("tis_high", 2.0)) if getattr(self, n) != d]
        correction = self.correction
        if not isinstance(correction, TisCorrection):
            if changed:
                instead = "which has no bounds" if correction.type == "none" else "set correction.low / high instead"
                raise ValueError(
                    f"{' and '.join(changed)}: the bounds of the `tis` correction, but correction is "
                    f"`{correction.type}`; leave them at their defaults ({instead})"
                )
            return self
        for top, own in (("tis_low", correction.low), ("tis_high", correction.high)):
            if own is not None and top in changed and own != getattr(self, top):
                side = top.removeprefix("tis_")
                raise ValueError(f"{top} ({getattr(self, top)}) and correction.{side} ({own}) disagree: set one")
        low, high = self.correction_options()["low"], self.correction_options()["high"]
        if low >= high:
            raise ValueError(f"the tis correction's low ({low}) must be below its high ({high})")
        return self

    def correction_options(self) -> dict[str, Any]:
        """The keyword parameters of the correction function (`workers.training.corrections.CORRECTIONS`)."""
        correction = self.correction
        if isinstance(correction, TisCorrection):
            low = self.tis_low if correction.low is None else correction.low
            high = self.tis_high if correction.high is None else correction.high
            return {"low": low, "high": high}
        return correction.model_dump(exclude={"type"})

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            host, _, port = value.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"rdzv_endpoint must be host:port (port 1-65535), got {value!r}")
        return value

    @model_validator(mode="after")
    def _replay_fits(self) -> TrainerConfig:
        if self.routing_replay == "off":
            return self
        if self.activation_checkpointing:
            raise ValueError(
                f"routing_replay {self.routing_replay} with activation_checkpointing: the recomputed forward would "
                "replay the routing a second time; turn one of them off"
            )
        if self.world_size > 1:
            raise ValueError(
                f"routing_replay {self.routing_replay} runs in one trainer process: set nproc and nnodes to 1"
            )
        return self

    @model_validator(mode="after")
    def _rendezvous_needs_nodes(self) -> TrainerConfig:
        if self.nnodes == 1 and (self.rdzv_endpoint is not None or self.rdzv_id is not None):
            raise ValueError("rdzv_endpoint and rdzv_id are for a trainer on several nodes: set nnodes above 1")
        return self

    @property
    def world_size(self) -> int:
        """Trainer ranks in all: every node runs `nproc`."""
        return self.nnodes * self.nproc

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates in one trainer step."""
        return self.mini_batches * self.ppo_epochs

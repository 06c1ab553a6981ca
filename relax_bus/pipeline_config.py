"""Run config sections of the RL pipeline: model, task, rewards, roles, rollout, trainer.

Pure data: these models import nothing heavy; the `workers` package turns them into models, engines
and losses. Each field's docstring is its documentation (`relax init --help` points here).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Section):
    """Where the policy comes from."""

    source: str = "tiny"
    """`tiny` (a small Llama built in code; `tiny:<hidden>x<layers>`), a local Hugging Face directory,
    or `hf:<repo>` on machines with hub access."""
    seed: int = 0
    """Seed of the initial weights of a built-in model."""


class TaskConfig(_Section):
    """The prompts and their reference answers."""

    type: str = "addition"
    """Dataset type: addition, reverse, jsonl."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Options of the dataset type (e.g. `path` for jsonl, `seed`, `limit`)."""


class RewardConfig(_Section):
    """One weighted reward term."""

    type: str
    """Reward type: exact, numeric, format, python."""
    weight: float = 1.0
    """Multiplier of this term."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Options of the reward type (e.g. `pattern` for format, `function: module:function` for python)."""
    timeout_s: float = Field(default=5.0, gt=0)
    """User code running longer than this scores 0 with the error recorded."""


class SimEngineConfig(_Section):
    """Timing of the simulated engine (`rollout.engine: sim`), which runs no model and only sleeps.

    One call on k prompt groups takes the longest of k log-normal draws (median `group_median_s`,
    shape `group_sigma`); loading a weights version takes `load_s`. Used to measure scheduling, the
    bus and the weight protocol on their own (`benchmarks/cluster_sim.py`, `benchmarks/scale.py`).
    """

    group_median_s: float = Field(default=0.0, ge=0)
    """Median generation time of one prompt group (0: generation is instant)."""
    group_sigma: float = Field(default=0.0, ge=0, le=4)
    """Log-normal shape of the per-group time: 0 makes every group take the median, 1 is long-tailed."""
    load_s: float = Field(default=0.0, ge=0)
    """Time to load one weights version into the engine (after the real fetch from the bus)."""
    seed: int | None = None
    """Seed of the time and sample draws; None draws differently in every worker."""


class RolloutConfig(_Section):
    """Generation."""

    engine: Literal["torch", "vllm", "sim"] = "torch"
    """Generation engine of the rollout workers (`sim`: no model, timed sleeps, see `sim`)."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature (the trainer computes log-probs at the same temperature)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    max_new_tokens: int = Field(default=8, ge=1)
    """Longest response."""
    batch_groups: int = Field(default=32, ge=1)
    """Prompt groups one engine call generates together (also the worker's in-flight budget)."""
    sim: SimEngineConfig = Field(default_factory=SimEngineConfig)
    """Timing of the simulated engine; ignored by the other engines."""

    def engine_options(self) -> dict[str, Any]:
        """Constructor options of the chosen engine beyond the model directory."""
        return self.sim.model_dump() if self.engine == "sim" else {}


class WarmupConfig(_Section):
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


class SimTrainerConfig(_Section):
    """A simulated optimizer step: the actor's loop, weight publishing and acks stay real, the update sleeps."""

    step_s: float = Field(default=0.0, ge=0)
    """Median time of one simulated optimizer step."""
    sigma: float = Field(default=0.0, ge=0, le=4)
    """Log-normal shape of the step time (0: every step takes `step_s`)."""
    seed: int | None = None
    """Seed of the step-time draws."""


class TrainerConfig(_Section):
    """The actor: GRPO-family loss with off-policy correction."""

    steps: int = Field(default=100, ge=1)
    """Optimizer steps of the run."""
    lr: float = Field(default=5e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient norm clip."""
    advantage: Literal["grpo", "drgrpo"] = "grpo"
    """grpo: (r - mean) / (std + eps) per group; drgrpo: r - mean."""
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """PPO ratio clip below 1."""
    clip_high: float = Field(default=0.28, ge=0)
    """PPO ratio clip above 1."""
    tis_low: float = Field(default=0.0, ge=0)
    """Lower bound of the truncated importance weight exp(logp_old - logp_rollout)."""
    tis_high: float = Field(default=2.0, gt=0)
    """Upper bound (cap) of the truncated importance weight."""
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
    nproc: int = Field(default=1, ge=1)
    """Trainer processes; above 1 runs under torchrun with FSDP2."""
    seed: int = 0
    """Seed of the trainer's own randomness (warm-up order)."""
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    simulate: SimTrainerConfig | None = None
    """Replace each optimizer update by a timed sleep (benchmarks of scheduling and the bus); the published
    weights then stay those the actor started with."""

    @model_validator(mode="after")
    def _tis_range(self) -> TrainerConfig:
        if self.tis_low >= self.tis_high:
            raise ValueError(f"tis_low ({self.tis_low}) must be below tis_high ({self.tis_high})")
        return self


class RolesConfig(_Section):
    """How many processes of each role `relax run` starts (others can join with `relax worker`)."""

    rollout: int = Field(default=1, ge=0)
    """Rollout (generation) processes."""
    reward: int = Field(default=1, ge=0)
    """Reward (scoring) processes."""
    reference: int = Field(default=1, ge=0)
    """Reference processes; ignored while `trainer.kl_coef` is 0 (the run then has no reference role)."""

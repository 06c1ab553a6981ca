"""The policy trainer, as a recipe: setup, one trainer step of PPO updates, state in and out.

One `step` takes B groups x n samples (N sequences) and makes `mini_batches x ppo_epochs` optimizer
updates on them (see `workers.training.microbatch` for how they are cut):

    rewards     r = rewards + overlong_penalty(response lengths)     # [B, n], when `trainer.overlong` is set
    advantages  A = group_advantages(r, trainer.advantage)           # [B, n] -> [N], once per step
    logp_old    = token_logprobs(policy, prompt + response, temp)    # [N, T-1], no grad, before the first
                                                                     # update (= logp.detach() with one update)
    for epoch, for mini-batch, accumulated over its micro-batches:
      logp      = token_logprobs(policy, ...)                        # with grad
      A_t       = coef (d_t - b_t) + reward_coef A                   # per token, once per step, in a run with a
                                                                     # teacher, d_t = logp_teacher - logp_rollout, b_t
                                                                     # its group baseline (`workers.training.distill`)
                  or GAE(r, V_critic, gamma, lam)                    # per token, in a run with a critic
                                                                     # (`workers.training.gae`)
      loss      = policy_loss(logp, logp_old, logp_rollout, A)       # trainer.loss, reweighted by trainer.correction
                + kl_coef * aggregate(kl_penalty(logp, logp_ref))    # when a reference is in the chain
      clip the gradient norm; AdamW update; lr schedule step

What varies with the config is chosen once, when the trainer is built, so the step reads the same for all:

    forward   how a micro-batch becomes log-probs (`workers.training.forward`): plain; shared-prompt (each
              distinct prompt forwarded once, its key/value cache reused for its group; `trainer.compute.shared_prompt`,
              on by default in one process); media (a multimodal policy); the text ones routed under
              `trainer.moe.routing_replay` (mixture-of-experts policies: forced to the rollout's experts, r3, or to
              the trainer's own routing before the first update, r2; `workers.training.routing_replay`)
    ranks     one process, or FSDP2 (`workers.training.ranks`, below)

The PPO ratio exp(logp - logp_old) is 1 in the first update and moves from the second on, where the
clip binds; the off-policy gap between the trainer's old policy and the rollout engine's policy is
corrected by `trainer.correction` (by default icepop: the importance weight exp(logp_old - logp_rollout) where
it lies within [low, high], 0 outside; docs/algorithms.md lists the losses and corrections). A published
policy version is one trainer step: all of its updates.

With `trainer.distributed.nproc > 1` every rank runs this same code under torchrun: the model is sharded with
FSDP2 (`fully_shard`) and each rank takes its share of each mini-batch; the loss is normalised over the
whole mini-batch on every rank, so tokens weigh as in one process whatever the ranks hold.

The checkpoints of model, optimizer and schedule are `self.checkpoints` (`workers.checkpoints`); the supervised
warm-up before RL is `workers.training.warmup`, which uses the trainer. With `trainer.sft` each update also takes a
supervised term on a dataset's rows (`workers.training.sft_mix`), added to its gradient before the clip.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from relax_bus.log import get_logger
from schemas import TrainGroup
from workers.checkpoints.trainer_state import TrainerCheckpoints
from workers.config import PipelineConfig as RunConfig
from workers.data.jsonl_task import task_media_root
from workers.engines.base import MediaInputs
from workers.training.advantages import ADVANTAGE_ESTIMATORS, group_advantages, shaped_rewards
from workers.training.batch import Batch, make_batch, stale_masked, untrainable
from workers.training.devices import compute_dtype, resolve_device
from workers.training.distill import Advantages, DistillTerm, StepTokens, reward_advantages
from workers.training.forward import forward_for
from workers.training.gae import GaeTerm, explained_variance, gae
from workers.training.losses import KlTerm, no_kl, normalizer_of
from workers.training.media_policy import load_policy
from workers.training.microbatch import Plan, split_even
from workers.training.optim import make_optimizer, make_scheduler
from workers.training.policy_losses import LossSettings, policy_loss
from workers.training.ranks import ranks_for
from workers.training.routing_replay import TrainerRouting
from workers.training.sft_mix import sft_mix_for
from workers.training.step_metrics import StepSums, UpdateSums, batch_metrics
from workers.weights.adapter import adapter_params, in_model, inject, published, split
from workers.weights.adapter_wire import base_digest

log = get_logger(__name__)


class PolicyTrainer:
    """Model, optimizer, schedule and the step; identical on every rank."""

    def __init__(self, model_dir: Path, config: RunConfig) -> None:
        self.config = config
        self.cfg = cfg = config.trainer
        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg.compute.device)
        self.dtype = compute_dtype(cfg.compute.precision, self.device)
        self.ranks = ranks_for(self.device, self.dtype)
        """One process or FSDP2 (`workers.training.ranks`): sharding, each rank's rows, padding, sums."""
        self.rank, self.world = self.ranks.rank, self.ranks.world
        model, self.tokenizer, self.prompter = load_policy(model_dir)
        """`prompter`: a multimodal policy's processor (`workers.training.media_policy`), None for a text one."""
        if self.prompter is not None:
            self.prompter.media_root = task_media_root(config.task)  # local media files: the task's directory only
        self.lora = cfg.lora
        """`trainer.lora`: the base frozen, only the adapter trains, and is what versions after v0 publish."""
        if self.lora is not None:
            inject(model, self.lora)  # before sharding and the optimizer: they see the adapter's parameters
        self.model = model.to(self.device)
        if self.prompter is not None and (self.world > 1 or cfg.moe.routing_replay != "off"):
            raise ValueError(
                "a multimodal policy trains in one process (trainer.distributed.nproc 1) without routing replay"
            )
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        """Token ids at or above this are refused before they reach a step (`workers.training.batch.untrainable`)."""
        text_config = self.model.config.get_text_config()
        self.max_tokens: int | None = getattr(text_config, "max_position_embeddings", None)
        """The model's context: a longer prompt + response is refused before it reaches a step, as the rollout
        refuses a prompt that leaves no room for its response."""
        if cfg.compute.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.base_digest = None if self.lora is None else base_digest(split(published(self.model.state_dict()))[0])
        """With LoRA: the frozen base's digest (every rank, before sharding), which whole checkpoints carry."""
        self.ranks.shard(self.model)
        replay = cfg.moe.routing_replay
        self.routing = None if replay == "off" else TrainerRouting(self.model, replay, cfg.moe.metrics_fraction)
        # One forward per backward under FSDP2 and with checkpointing (which turns the KV cache off); a multimodal
        # policy shares each prompt its own way (`workers.omni.group_forward`).
        self.forward = forward_for(
            self.model,
            self.device,
            config.rollout.temperature,
            self.ranks.autocast,
            media=self.prompter is not None,
            shared_prompt=cfg.compute.shared_prompt and self.world == 1 and not cfg.compute.activation_checkpointing,
            routing=self.routing,
        )
        """How micro-batches become log-probs (`workers.training.forward`), chosen here once."""
        self.loss_settings = LossSettings.of(cfg)
        self.kl_term = KlTerm(cfg.kl.coef, cfg.kl.kind, cfg.aggregation) if cfg.kl.coef > 0 else no_kl
        teacher, critic = config.teacher, config.critic
        self.advantages: Advantages = reward_advantages
        """The advantages of a step's tokens: the reward's, with the teacher's per-token term, or GAE's."""
        if teacher is not None:
            self.advantages = DistillTerm(teacher.coef, teacher.reward_coef, teacher.baseline)
        elif critic is not None:
            self.advantages = GaeTerm(critic.gamma, critic.lam)
        self.optimizer = make_optimizer(self.model, cfg.optim.lr, cfg.optim.weight_decay)
        updates = cfg.steps * cfg.updates_per_step
        self.scheduler = make_scheduler(
            self.optimizer, cfg.schedule.kind, cfg.schedule.warmup_updates, updates, cfg.schedule.min_lr_ratio
        )
        self.checkpoints = TrainerCheckpoints(
            self.model, self.optimizer, self.scheduler, self.rank, self.world, self.base_digest
        )
        """Model, optimizer and schedule in and out (`workers.checkpoints`)."""
        self.sft = sft_mix_for(self)
        """The supervised term of each update (`trainer.sft`; `workers.training.sft_mix`), or none."""

    def autocast(self) -> Any:
        """The precision context of a forward pass (one process; FSDP2 casts by its policy)."""
        return self.ranks.autocast()

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model on CPU (a collective: every rank calls it; rank 0 gets the tensors); with LoRA under the
        published names (`workers.weights.adapter`: the base's own names, the adapter's `lora_A.weight`)."""
        state = self.ranks.full_state(self.model)
        return state if self.lora is None else published(state)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """With LoRA, the adapter's tensors on CPU under their published names, in tensors of their own (what a
        version after v0 publishes; a collective under FSDP2, whose every rank gathers each parameter)."""
        params = adapter_params(self.model)
        return {
            k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to("cpu", copy=True)
            for k, p in params.items()
        }

    def load_full(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full (unsharded) state dict, e.g. the published v0 weights (a collective)."""
        self.ranks.load_full(self.model, state if self.lora is None else in_model(state, self.model))

    def untrainable(self, group: TrainGroup) -> str | None:
        """Why `group` cannot go into a step (`workers.training.batch.untrainable`, and R3's routing), or None."""
        if self.config.teacher is not None and group.teacher_logprobs is None:
            return "no teacher log-probs in a run that distills from a teacher"
        if self.config.critic is not None and group.critic is None:
            return "no critic values in a run with a critic"
        return untrainable(group, self.vocab_size, self.max_tokens) or self.forward.problem(group)

    # ---- RL step -----------------------------------------------------------------------------------------

    def step(
        self, groups: Sequence[TrainGroup], version: int | None = None, media: Sequence[MediaInputs | None] = ()
    ) -> dict[str, float]:
        """The step's optimizer updates on the groups (trained at policy `version`); the step's metrics (means over
        its updates). With `staleness.mask_stale_tokens`, tokens older than `version - max_staleness` are masked.
        `media[i]`: the processor tensors of group i's prompt (a multimodal policy; None for a text prompt)."""
        started = time.perf_counter()
        batch, masked = stale_masked(groups, make_batch(groups, media), version, self.config.staleness)
        rewards, shaping = shaped_rewards(batch, self.cfg.overlong)  # [B, n]
        adv = self._sequence_advantages(rewards, batch)  # [N]; the rewards themselves under `gae`
        value_fit = self._value_fit(batch)
        # [N], or [N, T-1] with a teacher or a critic: once per step, so a group's baseline sees all of its rows
        tokens = StepTokens(batch.rollout_logp, batch.mask, batch.group_of, batch.teacher_logp, batch.values)
        adv, distilled = self.advantages(adv, tokens)
        plans = [self._plan(batch, rows) for rows in split_even(batch.ids.shape[0], self.cfg.mini_batches)]
        self.forward.begin_step()
        updates = self.cfg.updates_per_step
        old = None if updates == 1 else self._old_logprobs(batch, plans)  # one update: logp_old = logp.detach()
        sums = StepSums()
        for _ in range(self.cfg.ppo_epochs):
            for plan in plans:
                sums.add(self._update(batch, adv, old, plan))
                self.forward.pass_done()
        return {
            **sums.means(updates),
            **shaping,
            **value_fit,
            **masked,
            **distilled,
            **self.forward.metrics(),
            "updates": float(updates),
            "lr": float(self.scheduler.get_last_lr()[0]),
            **batch_metrics(batch),
            "train_s": time.perf_counter() - started,
        }

    def _sequence_advantages(self, rewards: torch.Tensor, batch: Batch) -> torch.Tensor:
        """A = group_advantages(r) per response: [B, n] -> [N]; under `gae` the rewards themselves (the per-token
        advantages come from them and the critic's values, once per step: `GaeTerm`)."""
        estimator = self.cfg.advantage
        if estimator.type == "gae":
            return ADVANTAGE_ESTIMATORS["gae"](rewards, 0.0).reshape(-1)
        return group_advantages(rewards, estimator.type, estimator.eps, estimator.whiten, batch.valid).reshape(-1)

    def _value_fit(self, batch: Batch) -> dict[str, float]:
        """`explained_variance` of the critic's values over the step's trained tokens, 1 - Var(R - V) / Var(R) with
        R the GAE returns (`workers.training.gae`); empty in a run without a critic."""
        critic = self.config.critic
        if critic is None or batch.values is None:
            return {}
        _, returns = gae(batch.rewards.reshape(-1), batch.values, batch.mask, critic.gamma, critic.lam)
        return {"explained_variance": explained_variance(batch.values, returns, batch.mask)}

    def _plan(self, batch: Batch, rows: range) -> Plan:
        """This rank's micro-batches (row indices) of a mini-batch, padded to as many passes as any rank makes."""
        mine = self.ranks.share(rows)
        lengths, group_of = [batch.lengths[r] for r in mine], [batch.group_of[r] for r in mine]
        packed = self.forward.pack(lengths, group_of, self.cfg.compute.micro_batch_tokens)
        micro = [[mine[i] for i in rows] for rows in packed]
        return Plan(micro, padding=self.ranks.most(len(micro)) - len(micro))

    @torch.no_grad()
    def _old_logprobs(self, batch: Batch, plans: list[Plan]) -> torch.Tensor:
        """log pi_old of every row of this rank before the step's first update: [N, T-1] on the CPU."""
        old = torch.zeros_like(batch.rollout_logp)
        for plan in plans:
            for rows in plan.micro:
                _, logp = self.forward.logprobs(batch, rows, old=True)
                old[torch.tensor(rows), : logp.shape[1]] = logp.float().cpu()
            self.ranks.empty_passes(self.model, plan.padding, backward=False)
        self.forward.pass_done()
        return old

    def _update(self, batch: Batch, adv: torch.Tensor, old: torch.Tensor | None, plan: Plan) -> dict[str, float]:
        """One optimizer update on a mini-batch, accumulated over its micro-batches; that update's metrics."""
        mask = batch.mask[torch.tensor(plan.rows, dtype=torch.long)]  # this rank's share
        normalizer, tokens = self.ranks.sum([normalizer_of(mask, self.cfg.aggregation), float(mask.sum())])
        sums = UpdateSums()
        self.optimizer.zero_grad(set_to_none=True)
        for rows in plan.micro:
            mb, logp = self.forward.logprobs(batch, rows)
            logp_old = logp.detach() if old is None else old[torch.tensor(rows), : logp.shape[1]].to(self.device)
            loss, metrics = self._loss(mb, logp, logp_old, adv[torch.tensor(rows)].to(self.device), normalizer)
            if not loss.requires_grad:  # no trained token in it (episodes that ended before a policy turn)
                loss = loss + 0.0 * logp.sum()  # a zero gradient, and every rank's backward all the same
            (loss * self.ranks.loss_scale).backward()  # FSDP2 averages gradients over ranks
            sums.add(loss, metrics, float(mb.mask.sum()))
        self.ranks.empty_passes(self.model, plan.padding, backward=True)
        sft = self.sft.backward(self.scheduler.last_epoch)  # the supervised rows of this update (trainer.sft)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return {**sums.reduced(self.ranks, tokens), "grad_norm": self.ranks.scalar(grad_norm), **sft}

    def _loss(
        self, mb: Batch, logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, normalizer: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """A micro-batch's share of the mini-batch's loss: the policy loss (on the teacher's per-token advantages in
        a run with a teacher or a critic: `adv` [rows, T-1], cut here to the micro-batch's width), plus the KL term
        against the reference when the run has one (`trainer.kl.coef` > 0; its value then in the metrics' `kl`)."""
        adv = adv if adv.dim() == 1 else adv[:, : logp.shape[1]]
        loss, metrics = policy_loss(logp, logp_old, mb.rollout_logp, adv, mb.mask, self.loss_settings, normalizer)
        loss, kl = self.kl_term(loss, logp, mb.ref_logp, mb.mask, normalizer)
        return loss, {**metrics, **kl}

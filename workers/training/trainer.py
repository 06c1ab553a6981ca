"""The policy trainer, as a recipe: setup, one trainer step of PPO updates, state in and out.

One `step` takes B groups x n samples (N sequences) and makes `mini_batches x ppo_epochs` optimizer
updates on them (see `workers.training.microbatch` for how they are cut):

    rewards     r = rewards + overlong_penalty(response lengths)     # [B, n], when `trainer.overlong` is set
    advantages  A = group_advantages(r, trainer.advantage)           # [B, n] -> [N], once per step
    logp_old    = token_logprobs(policy, prompt + response, temp)    # [N, T-1], no grad, before the first
                                                                     # update (= logp.detach() with one update)
    for epoch, for mini-batch, accumulated over its micro-batches:
      logp      = token_logprobs(policy, ...)                        # with grad
      loss      = policy_loss(logp, logp_old, logp_rollout, A)       # trainer.loss, reweighted by trainer.correction
                + kl_coef * aggregate(kl_penalty(logp, logp_ref))    # when a reference is in the chain
      clip the gradient norm; AdamW update; lr schedule step

With `trainer.routing_replay` (mixture-of-experts policies) every forward is forced to the experts the rollout
engine routed each token to (r3), or to the trainer's own routing before the first update (r2); see
`workers.training.routing_replay`.

Each distinct prompt of a micro-batch is forwarded once and its key/value cache reused for the group's
responses (`workers.training.shared_prompt`; `trainer.shared_prompt`, on by default in one process).

The PPO ratio exp(logp - logp_old) is 1 in the first update and moves from the second on, where the
clip binds; the off-policy gap between the trainer's old policy and the rollout engine's policy is
corrected by `trainer.correction` (by default the truncated importance weight exp(logp_old - logp_rollout),
capped at `tis_high`; docs/algorithms.md lists the losses and corrections). A published
policy version is one trainer step: all of its updates.

With `trainer.nproc > 1` every rank runs this same code under torchrun: the model is sharded with
FSDP2 (`fully_shard`) and each rank takes its share of each mini-batch; the loss is normalised over the
whole mini-batch on every rank, so tokens weigh as in one process whatever the ranks hold.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from relax_bus.log import get_logger
from schemas import TrainGroup
from workers.config import PipelineConfig as RunConfig
from workers.data.tasks import TaskItem
from workers.engines.base import MediaInputs
from workers.training.advantages import group_advantages, overlong_penalty
from workers.training.batch import Batch, make_batch, older_tokens, untrainable
from workers.training.checkpoint_io import FULL, load_whole, whole_state, write_checkpoint
from workers.training.corrections import CORRECTION_METRICS
from workers.training.devices import autocast, compute_dtype, resolve_device
from workers.training.logprobs import token_logprobs
from workers.training.losses import aggregate, kl_penalty, normalizer_of
from workers.training.media_policy import load_policy, media_rows_logprobs
from workers.training.microbatch import pack, pack_groups, split_even
from workers.training.optim import make_optimizer, make_scheduler
from workers.training.policy_losses import LOSS_METRICS, policy_loss
from workers.training.routing_replay import TrainerRouting
from workers.training.sharded_checkpoint import ShardedCheckpoints
from workers.training.shared_prompt import grouped_logprobs, place

log = get_logger(__name__)

# Metrics averaged over a step's updates; the per-token ones are weighted by each micro-batch's tokens. The
# largest ones are maxima over micro-batches, ranks and the step's updates.
_LARGEST = ("tis_max",)
_TOKEN_METRICS = tuple(n for n in (*LOSS_METRICS, *CORRECTION_METRICS) if n not in _LARGEST)


class PolicyTrainer:
    """Model, optimizer, schedule and the step; identical on every rank."""

    def __init__(self, model_dir: Path, config: RunConfig) -> None:
        self.config = config
        self.cfg = config.trainer
        torch.manual_seed(self.cfg.seed)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.sharded = ShardedCheckpoints(self.rank, self.world)
        self.device = resolve_device(self.cfg.device)
        self.dtype = compute_dtype(self.cfg.precision, self.device)
        model, self.tokenizer, self.prompter = load_policy(model_dir)
        """`prompter`: a multimodal policy's processor (`workers.training.media_policy`), None for a text one."""
        self.model = model.to(self.device)
        if self.prompter is not None and (self.world > 1 or self.cfg.routing_replay != "off"):
            raise ValueError("a multimodal policy trains in one process (trainer.nproc 1) without routing replay")
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        """Token ids at or above this are refused before they reach a step (`workers.training.batch.untrainable`)."""
        if self.cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        if self.world > 1:
            self._shard()
        # One forward per backward under FSDP2 and with checkpointing (which turns the KV cache off); a multimodal
        # policy shares each prompt its own way (`workers.omni.group_forward`).
        self.shared_prompt = (
            self.cfg.shared_prompt
            and self.world == 1
            and not self.cfg.activation_checkpointing
            and self.prompter is None
        )
        replay = self.cfg.routing_replay
        self.routing = (
            None if replay == "off" else TrainerRouting(self.model, replay, self.cfg.routing_metrics_fraction)
        )
        self.optimizer = make_optimizer(self.model, self.cfg.lr, self.cfg.weight_decay)
        self.scheduler = make_scheduler(
            self.optimizer,
            self.cfg.lr_schedule,
            self.cfg.lr_warmup_updates,
            self.cfg.steps * self.cfg.updates_per_step,
            self.cfg.min_lr_ratio,
        )

    def _shard(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        for layer in self.model.model.layers:  # type: ignore[union-attr]
            fully_shard(layer, mp_policy=policy)
        fully_shard(self.model, mp_policy=policy)

    def autocast(self) -> Any:
        """The precision context of a forward pass (one process; FSDP2 casts by its policy)."""
        return autocast(self.device, self.dtype, enabled=self.world == 1)

    # ---- state -------------------------------------------------------------------------------------------

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model on CPU (a collective: every rank calls it; rank 0 gets the tensors)."""
        if self.world == 1:  # an unsharded module names the same tensors itself, ~5x faster than the traversal below
            return {k: v.cpu() for k, v in self.model.state_dict().items()}
        return {k: v.cpu() for k, v in get_model_state_dict(self.model, options=FULL).items()}

    def load_full(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full (unsharded) state dict, e.g. the published v0 weights (a collective)."""
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.world > 1)
        set_model_state_dict(self.model, state, options=options)

    def checkpoint_bytes(self, extra: dict[str, Any]) -> bytes:
        """Model, optimizer, lr schedule and `extra` as torch.save bytes (a collective)."""
        return self.serialize_checkpoint(self.checkpoint_state(extra))

    def checkpoint_state(self, extra: dict[str, Any]) -> dict[str, Any]:
        """Model, optimizer, lr schedule and `extra` as they are now, in tensors of their own (a collective; rank 0
        gets the tensors): the next step may train while `serialize_checkpoint` writes this out."""
        return whole_state(self.model, self.optimizer, self.scheduler, extra)

    def serialize_checkpoint(self, state: dict[str, Any]) -> bytes:
        """`checkpoint_state`'s result as torch.save bytes (tensors, containers and numbers only); b"" on ranks > 0."""
        return write_checkpoint(state) if self.rank == 0 else b""

    def restore(self, data: bytes) -> dict[str, Any]:
        """Load a checkpoint written by `checkpoint_bytes`; return its `extra` (ranks > 0 may pass b"")."""
        return load_whole(data, self.model, self.optimizer, self.scheduler, self.world)

    def save_sharded(self, path: str, extra: dict[str, Any]) -> Future[Any]:
        """Start a sharded checkpoint into directory `path` (a collective; `workers.training.sharded_checkpoint`);
        the future resolves once every rank's shards are written."""
        return self.sharded.save(Path(path), self.model, self.optimizer, self.scheduler, extra)

    def restore_sharded(self, path: str) -> dict[str, Any]:
        """Load the sharded checkpoint in `path` on this world size (a collective); return its `extra`."""
        return self.sharded.load(Path(path), self.model, self.optimizer, self.scheduler)

    # ---- RL step -----------------------------------------------------------------------------------------

    def untrainable(self, group: TrainGroup) -> str | None:
        """Why `group` cannot go into a step (`workers.training.batch.untrainable`, and R3's routing), or None."""
        why = untrainable(group, self.vocab_size)
        if why is None and self.routing is not None:
            why = self.routing.problem(group)
        return why

    def step(
        self, groups: Sequence[TrainGroup], version: int | None = None, media: Sequence[MediaInputs | None] = ()
    ) -> dict[str, float]:
        """The step's optimizer updates on the groups (trained at policy `version`); the step's metrics (means over
        its updates). With `staleness.mask_stale_tokens`, tokens older than `version - max_staleness` are masked.
        `media[i]`: the processor tensors of group i's prompt (a multimodal policy; None for a text prompt)."""
        started = time.perf_counter()
        batch = make_batch(groups, media)
        masked: dict[str, float] = {}
        bound = self.config.staleness.max_staleness
        if self.config.staleness.mask_stale_tokens and bound is not None and version is not None:
            older = older_tokens(groups, batch, version - bound)
            batch = dataclasses.replace(batch, mask=batch.mask * (1 - older))
            masked = {"masked_stale_tokens": float(older.sum())}
        rewards, shaping = self._shaped_rewards(batch)  # [B, n]
        estimator = self.cfg.advantage
        adv = group_advantages(rewards, estimator.type, estimator.eps, estimator.whiten).reshape(-1)  # [N]
        plans = [self._plan(batch, rows) for rows in split_even(batch.ids.shape[0], self.cfg.mini_batches)]
        one_update = self.cfg.updates_per_step == 1
        if self.routing is not None:
            self.routing.begin_step()
        old = None if one_update else self._old_logprobs(batch, plans)
        if old is not None and self.routing is not None:
            self.routing.measured()  # in the pass before the first update, on the old policy
        totals: dict[str, float] = defaultdict(float)
        largest: dict[str, float] = defaultdict(float)
        for _ in range(self.cfg.ppo_epochs):
            for plan in plans:
                for name, value in self._update(batch, adv, old, plan).items():
                    if name in _LARGEST:
                        largest[name] = max(largest[name], value)
                    else:
                        totals[name] += value
                if self.routing is not None:
                    self.routing.measured()
        updates = self.cfg.updates_per_step
        rewards = batch.rewards
        return {
            **{name: value / updates for name, value in totals.items()},
            **largest,
            **shaping,
            **masked,
            **(self.routing.metrics() if self.routing is not None else {}),
            "updates": float(updates),
            "lr": float(self.scheduler.get_last_lr()[0]),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "response_tokens": float(batch.mask.sum()),
            "train_s": time.perf_counter() - started,
        }

    def _shaped_rewards(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """The rewards the advantages are computed from ([B, n]) and the shaping's metrics (none when off)."""
        overlong = self.cfg.overlong
        if overlong is None:
            return batch.rewards, {}
        lengths = torch.tensor(
            [n - p for n, p in zip(batch.lengths, batch.prompt_lengths, strict=True)], dtype=batch.rewards.dtype
        ).reshape(batch.rewards.shape)  # [B, n] response tokens, rows in group order
        penalty = overlong_penalty(lengths, overlong.max_tokens, overlong.window, overlong.penalty)  # [B, n]
        shaped = {"overlong_penalty_mean": float(penalty.mean()), "overlong_frac": float((penalty < 0).float().mean())}
        return batch.rewards + penalty, shaped

    def _plan(self, batch: Batch, rows: range) -> list[list[int]]:
        """This rank's micro-batches (row indices) of a mini-batch; empty ones pad every rank to the same count."""
        share = self._share(len(rows))
        mine = list(rows)[share.start : share.stop]
        lengths, budget = [batch.lengths[r] for r in mine], self.cfg.micro_batch_tokens
        if self.shared_prompt:
            packed = pack_groups(lengths, [batch.group_of[r] for r in mine], budget)
        else:
            packed = pack(lengths, budget)
        micro = [[mine[i] for i in group] for group in packed]
        count = self._all_reduce([float(len(micro))], dist.ReduceOp.MAX)[0] if self.world > 1 else len(micro)
        return micro + [[] for _ in range(int(count) - len(micro))]

    def _share(self, n: int) -> range:
        return split_even(n, self.world)[self.rank]

    @torch.no_grad()
    def _old_logprobs(self, batch: Batch, plans: list[list[list[int]]]) -> torch.Tensor:
        """log pi_old of every row of this rank before the step's first update: [N, T-1] on the CPU."""
        old = torch.zeros_like(batch.rollout_logp)
        for plan in plans:
            for rows in plan:
                if not rows:
                    self._empty_forward(backward=False)
                    continue
                _, logp = self._forward(batch, rows, old_pass=True)
                old[torch.tensor(rows), : logp.shape[1]] = logp.float().cpu()
        return old

    def _update(
        self, batch: Batch, adv: torch.Tensor, old: torch.Tensor | None, plan: list[list[int]]
    ) -> dict[str, float]:
        """One optimizer update on a mini-batch, accumulated over its micro-batches; that update's metrics."""
        cfg = self.cfg
        rows_all = [r for rows in plan for r in rows]
        mask_all = batch.mask[torch.tensor(rows_all, dtype=torch.long)] if rows_all else batch.mask[:0]
        local = [normalizer_of(mask_all, cfg.aggregation), float(mask_all.sum())]
        normalizer, tokens = self._all_reduce(local) if self.world > 1 else local
        use_kl = cfg.kl_coef > 0 and batch.ref_logp is not None
        sums: dict[str, float] = defaultdict(float)
        self.optimizer.zero_grad(set_to_none=True)
        for rows in plan:
            if not rows:
                self._empty_forward(backward=True)
                continue
            mb, logp = self._forward(batch, rows)
            logp_old = logp.detach() if old is None else old[torch.tensor(rows), : logp.shape[1]].to(self.device)
            loss, metrics = policy_loss(
                logp,
                logp_old,
                mb.rollout_logp,
                adv[torch.tensor(rows)].to(self.device),
                mb.mask,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                aggregation=cfg.aggregation,
                normalizer=normalizer,
                loss=cfg.loss.type,
                correction=cfg.correction.type,
                loss_options=cfg.loss.options(),
                correction_options=cfg.correction_options(),
            )
            if use_kl:
                assert mb.ref_logp is not None
                kl = aggregate(
                    kl_penalty(logp, mb.ref_logp, mb.mask, cfg.kl_kind), mb.mask, cfg.aggregation, normalizer
                )
                loss = loss + cfg.kl_coef * kl
                sums["kl"] += float(kl.detach())
            # FSDP2 averages gradients over ranks; each rank's share is already normalised over all of them.
            (loss * self.world).backward()
            sums["loss"] += float(loss.detach())
            weight = float(mb.mask.sum())
            for name in _TOKEN_METRICS:
                sums[name] += metrics[name] * weight
            for name in _LARGEST:
                sums[name] = max(sums[name], metrics[name])
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        names = ["loss", "kl", *_TOKEN_METRICS]
        values = [sums[n] for n in names]
        largest = [sums[n] for n in _LARGEST]
        if self.world > 1:
            values = self._all_reduce(values)
            largest = self._all_reduce(largest, dist.ReduceOp.MAX)
        out = dict(zip([*names, *_LARGEST], [*values, *largest], strict=True))
        for name in _TOKEN_METRICS:
            out[name] /= max(tokens, 1.0)
        out["grad_norm"] = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        return out

    def _forward(self, batch: Batch, rows: list[int], old_pass: bool = False) -> tuple[Batch, torch.Tensor]:
        """The rows on this rank's device and their token log-probs [rows, width-1] (with grad when enabled),
        under routing replay when it is on (`old_pass`: the no-grad pass before the first update)."""
        if self.routing is None:
            return self._logprobs(batch.rows(rows, self.device))
        with self.routing.forward(self.model, batch, rows, self.shared_prompt, old_pass) as replayer:
            mb, logp = self._logprobs(batch.rows(rows, self.device))
        with self.autocast():
            self.routing.measure(self.model, mb, logp, replayer, self.config.rollout.temperature)
        return mb, logp

    def _logprobs(self, mb: Batch) -> tuple[Batch, torch.Tensor]:
        temperature = self.config.rollout.temperature
        with self.autocast():
            if self.prompter is not None:
                rows = (mb.ids, mb.attention, mb.media, mb.group_of)
                return mb, media_rows_logprobs(self.model, *rows, temperature, mb.prompt_lengths)
            if not self.shared_prompt:
                return mb, token_logprobs(self.model, mb.ids, mb.attention, temperature)
            first: dict[int, int] = {}  # group -> its first row here: the distinct prompts, in order
            for i, g in enumerate(mb.group_of):
                first.setdefault(g, i)
            slot = {g: s for s, g in enumerate(first)}
            ids = mb.ids.tolist()
            prompts = [ids[i][: mb.prompt_lengths[i]] for i in first.values()]
            responses = [ids[i][p:n] for i, (p, n) in enumerate(zip(mb.prompt_lengths, mb.lengths, strict=True))]
            logps = grouped_logprobs(self.model, prompts, responses, [slot[g] for g in mb.group_of], temperature)
        return mb, place(logps, mb.prompt_lengths, mb.ids.shape[1])

    def _empty_forward(self, backward: bool) -> None:
        """A forward (and backward) that changes nothing: FSDP2's collectives need every rank in every pass."""
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        with self.autocast():
            logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        if backward:
            (logits.float().sum() * 0.0).backward()

    def _all_reduce(self, values: list[float], op: Any = None) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op)
        return [float(v) for v in tensor.cpu()]

    # ---- supervised warm-up ------------------------------------------------------------------------------

    def warmup(self, items: Sequence[TaskItem]) -> dict[str, float]:
        """Supervised steps on the task's answers before RL (see `workers.training.warmup`)."""
        from workers.training.warmup import run_warmup

        return run_warmup(self, items)

    def sampled_accuracy(self, items: Sequence[TaskItem]) -> float:
        """Fraction of one temperature-1 sample per item that exactly matches the answer (then eos)."""
        from workers.training.warmup import sampled_accuracy

        return sampled_accuracy(self, items)

"""The policy trainer, as a recipe: setup, warm-up, one GRPO step, state in and out.

One `step` is one optimizer update on B groups x n samples:

    advantages  A = group_advantages(rewards)                       # [B, n], grpo or drgrpo
    logp        = token_logprobs(policy, prompt + response, temp)   # [N, T-1], N = B*n, grad
    logp_old    = logp.detach()                                     # one update per step: the ratio is 1
    loss        = policy_loss(logp, logp_old, logp_rollout, A)      # decoupled PPO + TIS vs the rollout engine
                + kl_coef * aggregate(kl_penalty(logp, logp_ref))   # when a reference is in the chain

Deviation from textbook PPO: there is no second pass over the batch, so the clipped ratio only
matters once several updates reuse a batch; the off-policy correction of asynchronous rollouts is
entirely the truncated importance weight exp(logp_old - logp_rollout), capped at `tis_high`.

With `trainer.nproc > 1` every rank runs this same code under torchrun: the model is sharded with
FSDP2 (`fully_shard`, gloo on CPU, nccl on GPU) and each rank takes its share of the sequences.
"""

from __future__ import annotations

import io
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from relax_bus.log import get_logger
from relax_bus.settings import RunConfig
from schemas import TrainGroup
from workers.advantages import group_advantages
from workers.logprobs import token_logprobs
from workers.losses import aggregate, kl_penalty, policy_loss
from workers.models import load_model, load_tokenizer
from workers.tasks import TaskItem, prompt_text

log = get_logger(__name__)

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass(frozen=True)
class Batch:
    """A step's sequences as padded tensors (right padding)."""

    ids: torch.Tensor  # [N, T] long
    attention: torch.Tensor  # [N, T] long
    mask: torch.Tensor  # [N, T-1] float, 1 on response tokens (aligned with token_logprobs)
    rollout_logp: torch.Tensor  # [N, T-1] float
    ref_logp: torch.Tensor | None  # [N, T-1] float
    rewards: torch.Tensor  # [B, n] float


def make_batch(groups: Sequence[TrainGroup]) -> Batch:
    """Pack B train groups of n samples each into padded tensors."""
    rows: list[tuple[list[int], list[int], list[float], list[float] | None]] = []
    rewards = []
    for g in groups:
        rollout = g.scored.rollout
        prompt = list(rollout.prompt_token_ids.to_values())
        rewards.append(list(g.scored.rewards))
        for i, s in enumerate(rollout.samples):
            ref = list(g.ref_logprobs[i].to_values()) if g.ref_logprobs is not None else None
            rows.append((prompt, list(s.token_ids.to_values()), list(s.logprobs.to_values()), ref))  # type: ignore[arg-type]
    width = max(len(p) + len(r) for p, r, _, _ in rows)
    n = len(rows)
    ids = torch.zeros(n, width, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width - 1)
    rollout_logp = torch.zeros(n, width - 1)
    ref_logp = torch.zeros(n, width - 1) if rows[0][3] is not None else None
    for row, (prompt, response, lps, ref) in enumerate(rows):
        p, r = len(prompt), len(response)
        ids[row, : p + r] = torch.tensor(prompt + response)
        attention[row, : p + r] = 1
        mask[row, p - 1 : p - 1 + r] = 1  # logit at position t predicts token t+1
        rollout_logp[row, p - 1 : p - 1 + r] = torch.tensor(lps)
        if ref_logp is not None and ref is not None:
            ref_logp[row, p - 1 : p - 1 + r] = torch.tensor(ref)
    return Batch(ids, attention, mask, rollout_logp, ref_logp, torch.tensor(rewards, dtype=torch.float32))


class PolicyTrainer:
    """Model, optimizer and the step; identical on every rank."""

    def __init__(self, model_dir: Path, config: RunConfig) -> None:
        self.config = config
        self.cfg = config.trainer
        torch.manual_seed(self.cfg.seed)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_model(model_dir)
        self.model.train()
        if self.world > 1:
            self._shard()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    def _shard(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for layer in self.model.model.layers:  # type: ignore[union-attr]
            fully_shard(layer)
        fully_shard(self.model)

    # ---- state -------------------------------------------------------------------------------------------

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model on CPU (a collective: every rank calls it; rank 0 gets the tensors)."""
        return get_model_state_dict(self.model, options=FULL)

    def load_full(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full (unsharded) state dict, e.g. the published v0 weights (a collective)."""
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.world > 1)
        set_model_state_dict(self.model, state, options=options)

    def checkpoint_bytes(self, extra: dict[str, Any]) -> bytes:
        """Model, optimizer and `extra` as torch.save bytes (a collective)."""
        state = {
            "model": get_model_state_dict(self.model, options=FULL),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=FULL),
            "extra": extra,
        }
        buf = io.BytesIO()
        if self.rank == 0:
            torch.save(state, buf)
        return buf.getvalue()

    def restore(self, data: bytes) -> dict[str, Any]:
        """Load a checkpoint written by `checkpoint_bytes`; return its `extra` (ranks > 0 may pass b"")."""
        state = (
            torch.load(io.BytesIO(data), weights_only=False) if data else {"model": {}, "optimizer": {}, "extra": {}}
        )
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.world > 1)
        set_model_state_dict(self.model, state["model"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        return dict(state["extra"])

    # ---- RL step -----------------------------------------------------------------------------------------

    def step(self, groups: Sequence[TrainGroup]) -> dict[str, float]:
        """One optimizer update on the groups; returns the step's metrics."""
        started = time.perf_counter()
        batch = make_batch(groups)
        adv = group_advantages(batch.rewards, self.cfg.advantage).reshape(-1)  # [N]
        rows = self._my_rows(batch.ids.shape[0])
        logp = token_logprobs(
            self.model, batch.ids[rows], batch.attention[rows], self.config.rollout.temperature
        )  # [n_local, T-1]
        mask = batch.mask[rows]
        loss, metrics = policy_loss(
            logp,
            logp.detach(),
            batch.rollout_logp[rows],
            adv[rows],
            mask,
            clip_low=self.cfg.clip_low,
            clip_high=self.cfg.clip_high,
            tis_low=self.cfg.tis_low,
            tis_high=self.cfg.tis_high,
            aggregation=self.cfg.aggregation,
        )
        kl_value = 0.0
        if self.cfg.kl_coef > 0 and batch.ref_logp is not None:
            kl = aggregate(kl_penalty(logp, batch.ref_logp[rows], mask, self.cfg.kl_kind), mask, self.cfg.aggregation)
            loss = loss + self.cfg.kl_coef * kl
            kl_value = float(kl.detach())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        rewards = batch.rewards
        return {
            "loss": float(loss.detach()),
            "kl": kl_value,
            "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "response_tokens": float(batch.mask.sum()),
            "train_s": time.perf_counter() - started,
            **metrics,
        }

    def _my_rows(self, n: int) -> slice:
        per = -(-n // self.world)
        return slice(self.rank * per, min(n, (self.rank + 1) * per))

    # ---- supervised warm-up ------------------------------------------------------------------------------

    def warmup(self, items: Sequence[TaskItem]) -> dict[str, float]:
        """Supervised steps on (prompt, answer) until sampled accuracy reaches the target or max_steps.

        With `label_noise` > 0, `noise_steps` more steps follow in which that fraction of the answers is
        replaced by wrong ones: the model keeps the task's format but loses its confidence, so RL starts
        from a weak, reproducible policy with a dense reward signal.
        """
        wcfg = self.cfg.warmup
        examples = [(self._prompt_ids(it), self._answer_ids(it)) for it in items if it.answer is not None]
        if wcfg.max_steps == 0 or not examples:
            return {"warmup_steps": 0.0, "warmup_accuracy": float("nan")}
        opt = torch.optim.AdamW(self.model.parameters(), lr=wcfg.lr)
        rng = random.Random(self.cfg.seed)
        accuracy = 0.0
        step = 0
        for step in range(1, wcfg.max_steps + 1):
            loss = self._sft_step(opt, [examples[rng.randrange(len(examples))] for _ in range(wcfg.batch_size)])
            if step % wcfg.check_every == 0:
                accuracy = self.sampled_accuracy(items[:64])
                log.info("warmup_progress", step=step, loss=round(loss, 4), accuracy=round(accuracy, 3))
                if accuracy >= wcfg.target_accuracy:
                    break
        answers = [a for _, a in examples]
        for _ in range(wcfg.noise_steps if wcfg.label_noise > 0 else 0):
            chosen = []
            for _ in range(wcfg.batch_size):
                prompt, answer = examples[rng.randrange(len(examples))]
                if rng.random() < wcfg.label_noise:
                    answer = rng.choice([a for a in answers if a != answer] or [answer])
                chosen.append((prompt, answer))
            self._sft_step(opt, chosen)
        if wcfg.label_noise > 0 and wcfg.noise_steps > 0:
            accuracy = self.sampled_accuracy(items[:64])
            log.info("warmup_noise_done", steps=wcfg.noise_steps, accuracy=round(accuracy, 3))
        return {"warmup_steps": float(step + wcfg.noise_steps), "warmup_accuracy": accuracy}

    def _sft_step(self, opt: torch.optim.Optimizer, chosen: Sequence[tuple[list[int], list[int]]]) -> float:
        """One supervised step: mean token log-loss of the answers after their prompts."""
        seqs = [p + a for p, a in chosen]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        attention = torch.zeros_like(ids)
        mask = torch.zeros(len(seqs), width - 1)
        for row, ((p, _), s) in enumerate(zip(chosen, seqs, strict=True)):
            ids[row, : len(s)] = torch.tensor(s)
            attention[row, : len(s)] = 1
            mask[row, len(p) - 1 : len(s) - 1] = 1
        logp = token_logprobs(self.model, ids, attention)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    @torch.no_grad()
    def sampled_accuracy(self, items: Sequence[TaskItem]) -> float:
        """Fraction of one temperature-1 sample per item that exactly matches the answer (then eos)."""
        self.model.eval()
        generator = torch.Generator().manual_seed(self.cfg.seed)
        try:
            eos = self.tokenizer.eos_token_id
            hits = 0
            for it in items:
                ids = torch.tensor([self._prompt_ids(it)])
                out: list[int] = []
                for _ in range(self.config.rollout.max_new_tokens):
                    logits = self.model(input_ids=ids, use_cache=False).logits[0, -1] / self.config.rollout.temperature
                    # One generator seeded alike on every rank: FSDP ranks must take identical branches.
                    token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
                    if token == eos:
                        break
                    out.append(token)
                    ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
                else:
                    continue
                hits += self.tokenizer.decode(out).strip() == (it.answer or "").strip()
            return hits / max(1, len(items))
        finally:
            self.model.train()

    def _prompt_ids(self, item: TaskItem) -> list[int]:
        return [self.tokenizer.bos_token_id, *self.tokenizer.encode(prompt_text(item.parts), add_special_tokens=False)]

    def _answer_ids(self, item: TaskItem) -> list[int]:
        return [*self.tokenizer.encode(item.answer or "", add_special_tokens=False), self.tokenizer.eos_token_id]


def init_distributed() -> None:
    """Join the torchrun process group when launched by torchrun (gloo on CPU, nccl on GPU)."""
    if "RANK" in os.environ and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)

"""Supervised rows mixed into RL (`trainer.sft`): every optimizer update of a trainer step adds a supervised term to
its RL loss, one more forward and backward over `batch_size` examples of a dataset (`workers.data.sft_dataset`):

    rows(u)   positions u*b .. u*b + b - 1 (b = batch_size) of the dataset's endless order, in which pass e
              (position // count) is a permutation of its rows seeded by (seed, e)            (`rows_of_update`)
    loss(u)   = RL loss of the mini-batch
              + coef * sum_{rows(u), trained tokens} -log pi(token) / tokens(rows(u))         (coef x mean CE)

u counts the trainer's optimizer updates since the run began: the learning-rate schedule's counter, which every
checkpoint holds, so a restarted actor goes on with the rows after those of its checkpoint and keeps no state of its
own here (a retried step's rows follow those of its failed updates).

The rows are built as the warm-up's (`workers.training.supervised`): the prompt as the rollout role renders it, the
answer then EOS, prompt tokens masked; log-probs at temperature 1 (the RL term's are at the rollout's temperature),
without routing replay (no rollout routed them). They are packed into micro-batches of
`trainer.compute.micro_batch_tokens` as the RL rows are, each micro-batch its share of the mean. Under FSDP2 each
rank takes its even share of the rows and the mean is over every rank's tokens, as for the RL loss
(`workers.training.ranks`). The gradient joins the update's before its clip, so `trainer.optim.grad_clip` bounds
the sum.

Metrics: `sft_loss`, the mean cross-entropy of an update's rows before `coef` (averaged over the step's updates), and
`sft_s`, the seconds the step spent on them (summed over its updates; `train_s` includes them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from workers.config.trainer import TrainerConfig
from workers.data.sft_dataset import sft_items
from workers.data.task_items import TaskItem, report_errors
from workers.data.tasks import epoch_order
from workers.training.microbatch import pack
from workers.training.ranks import OneProcess
from workers.training.supervised import Policy, item_prompt, item_target, supervised_logprobs


def rows_of_update(update: int, batch_size: int, count: int, seed: int) -> list[int]:
    """The dataset rows (of `count`) of optimizer update `update`: positions update * batch_size .. + batch_size - 1
    of the endless sequence of passes over the dataset, pass e the permutation `epoch_order(count, e + 1, seed)`
    (every pass shuffled, the first too): each pass trains every row once."""
    rows = []
    for position in range(update * batch_size, (update + 1) * batch_size):
        epoch, at = divmod(position, count)
        rows.append(epoch_order(count, epoch + 1, seed)[at])
    return rows


class Trainer(Policy, Protocol):
    """What the mixing needs of the trainer besides a `Policy`: its settings, ranks and the model's context."""

    @property
    def cfg(self) -> TrainerConfig:
        """The trainer's settings (`trainer.sft`, `trainer.compute.micro_batch_tokens`)."""

    @property
    def ranks(self) -> OneProcess:
        """One process or FSDP2: each rank's share of the rows, the sums over ranks, the padding passes."""

    @property
    def max_tokens(self) -> int | None:
        """The model's context, None when it names none."""


class NoSft:
    """`trainer.sft` null: no supervised term."""

    def backward(self, update: int) -> dict[str, float]:
        """Nothing to add to update `update`; no metrics."""
        return {}


class SftMix:
    """The dataset's examples as token ids, and the supervised term of each optimizer update."""

    def __init__(self, trainer: Trainer, items: Sequence[TaskItem]) -> None:
        assert trainer.cfg.sft is not None
        self.trainer = trainer
        self.settings = trainer.cfg.sft
        tok = trainer.tokenizer
        self.examples = [(item_prompt(trainer, it), item_target(tok, it)) for it in items]
        limit = trainer.max_tokens
        too_long = [
            (i, f"{len(p) + len(a)} tokens, more than the model's context of {limit}")
            for i, ((p, _), (a, _)) in enumerate(self.examples)
            if limit is not None and len(p) + len(a) > limit
        ]
        if too_long:  # refused here, not in every step that would draw the example
            raise ValueError(report_errors(f"sft dataset {self.settings.dataset}", "example", too_long))

    def backward(self, update: int) -> dict[str, float]:
        """Accumulate `coef` x the mean cross-entropy of update `update`'s rows into the gradients (this rank's share
        of them; a collective under FSDP2); the metrics `sft_loss` and `sft_s`."""
        started = time.perf_counter()
        trainer, ranks, settings = self.trainer, self.trainer.ranks, self.settings
        order = rows_of_update(update, settings.batch_size, len(self.examples), settings.seed)
        chosen = [self.examples[i] for i in order]
        mine = [chosen[i] for i in ranks.share(range(len(chosen)))]
        lengths = [len(p) + len(a) for (p, _), (a, _) in mine]
        micro = [[mine[i] for i in rows] for rows in pack(lengths, trainer.cfg.compute.micro_batch_tokens)]
        (tokens,) = ranks.sum([float(sum(sum(trained) for _, (_, trained) in mine))])  # every rank's trained tokens
        padding = ranks.most(len(micro)) - len(micro)  # before the passes: every collective in the same order
        nll_sum = 0.0
        for rows in micro:
            logp, mask = supervised_logprobs(trainer, rows)
            nll = -(logp * mask).sum() / tokens  # [] this micro-batch's share of the mean over every rank's rows
            (settings.coef * nll * ranks.loss_scale).backward()  # FSDP2 averages gradients over ranks
            nll_sum += float(nll.detach())
        ranks.empty_passes(trainer.model, padding, backward=True)
        (loss,) = ranks.sum([nll_sum])
        return {"sft_loss": loss, "sft_s": time.perf_counter() - started}


def sft_mix_for(trainer: Trainer) -> SftMix | NoSft:
    """The supervised term of `trainer.sft`, its dataset loaded and tokenized; `NoSft` when it is null."""
    if trainer.cfg.sft is None:
        return NoSft()
    return SftMix(trainer, sft_items(trainer.cfg.sft.dataset))

"""Supervised rows: an item's prompt and target as token ids, rows padded for one forward, and their log-probs.

The supervised warm-up before RL (`workers.training.warmup`) and the supervised rows mixed into RL updates
(`workers.training.sft_mix`) both build their rows here, so both train on the ids the rollout role would render:

    prompt   the item's prompt as the rollout role renders it (`item_prompt`; media through a multimodal
             policy's processor)
    target   its first demonstration, segment by segment, or its answer; then EOS (`item_target`); with a 0/1 per
             id, 1 where trained (an environment's observation in a demonstration is context, 0)
    row      prompt + target, right padded; the mask of the trained target ids aligned with `token_logprobs`
             (the logit at t predicts token t+1): [N, T-1] (`sft_tensors`)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from workers.config import PipelineConfig
from workers.data.prompts import answer_ids, prompt_ids
from workers.data.task_items import Demo
from workers.data.tasks import TaskItem, prompt_text
from workers.envs.formats import prompt_tools
from workers.omni.media_refs import has_media
from workers.training.logprobs import token_logprobs
from workers.training.media_policy import media_rows_logprobs

if TYPE_CHECKING:
    from workers.engines.base import MediaInputs


Prompt = tuple[list[int], "MediaInputs | None"]
"""A prompt's ids and, for a media prompt of a multimodal policy, its processor tensors."""

Target = tuple[list[int], list[int]]
"""A supervised target after a prompt: its token ids and, per id, 1 when trained (0: an observation's, context)."""


class Policy(Protocol):
    """What supervised rows need of the trainer (`workers.training.trainer.PolicyTrainer`, which imports the mixing
    of them into RL, so it is named by its shape): the run's config, the model, its tokenizer and processor, where
    it computes."""

    @property
    def config(self) -> PipelineConfig:
        """The run's config (the prompt format, system prompt and agent's tools render prompts)."""

    @property
    def model(self) -> nn.Module:
        """The policy."""

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer."""

    @property
    def prompter(self) -> Any:
        """A multimodal policy's processor (`workers.training.media_policy`), None for a text one."""

    @property
    def device(self) -> torch.device:
        """Where the policy computes."""

    def autocast(self) -> Any:
        """The precision context of a forward pass."""


def item_prompt(trainer: Policy, item: TaskItem) -> Prompt:
    """The item's prompt, as the rollout role renders it (media through the policy's processor)."""
    if trainer.prompter is not None and has_media(item.parts):
        inputs = trainer.prompter.inputs(item.parts)
        return inputs["input_ids"][0].tolist(), inputs
    config = trainer.config
    model = config.model
    text = prompt_text(item.parts)
    tools = prompt_tools(config.agent)
    ids = prompt_ids(trainer.tokenizer, text, model.prompt_format, model.system_prompt, item.history, tools)
    return ids, None


def item_target(tokenizer: Any, item: TaskItem) -> Target:
    """The clean target of an item: its first demonstration, or its answer then EOS."""
    if item.demos:
        return demo_ids(tokenizer, item.demos[0])
    assert item.answer is not None
    ids = answer_ids(tokenizer, item.answer)
    return ids, [1] * len(ids)


def demo_ids(tokenizer: Any, demo: Demo) -> Target:
    """A demonstration's ids, segment by segment as the rollout appends them, then EOS; and which are trained."""
    ids: list[int] = []
    trained: list[int] = []
    for text, train in demo:
        part = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
        ids += part
        trained += [int(train)] * len(part)
    ids.append(int(tokenizer.eos_token_id))
    trained.append(1)
    return ids, trained


def sft_tensors(rows: Sequence[tuple[list[int], Target]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt ids, target) rows as right-padded ids [N, T], attention [N, T] and the mask of the trained target
    tokens [N, T-1], aligned with `token_logprobs` (the logit at t predicts token t+1)."""
    seqs = [p + a for p, (a, _) in rows]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros(len(seqs), width - 1)
    for row, ((p, (_, trained)), s) in enumerate(zip(rows, seqs, strict=True)):
        ids[row, : len(s)] = torch.tensor(s)
        attention[row, : len(s)] = 1
        mask[row, len(p) - 1 : len(s) - 1] = torch.tensor(trained, dtype=mask.dtype)
    return ids, attention, mask


def supervised_logprobs(trainer: Policy, chosen: Sequence[tuple[Prompt, Target]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token log-probs [N, T-1] of (prompt, target) rows at temperature 1 (with grad when enabled), and the mask of
    their trained target tokens [N, T-1], both on the trainer's device: -(logp * mask).sum() is their log-loss."""
    ids, attention, mask = sft_tensors([(p, target) for (p, _), target in chosen])
    device = trainer.device
    with trainer.autocast():
        if trainer.prompter is not None:
            media = [m for (_, m), _ in chosen]
            logp = media_rows_logprobs(
                trainer.model, ids.to(device), attention.to(device), media, range(len(chosen)), 1.0
            )
        else:
            logp = token_logprobs(trainer.model, ids.to(device), attention.to(device))
    return logp, mask.to(device)

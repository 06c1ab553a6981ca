"""Supervised warm-up of the policy before RL, and the sampled accuracy that decides when it stops.

A random or weak model earns no reward, so RL has no signal: a few supervised steps on the task's
reference answers (prompt rendered like the rollout role renders it, answer then EOS) start it off.
The rows are built by `workers.training.supervised`, as are those mixed into RL updates (`trainer.sft`).
Everything here runs on every FSDP2 rank alike (`workers.training.distributed.warm_up` mirrors `run_warmup`).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from relax_bus.log import get_logger
from workers.data.tasks import TaskItem
from workers.omni.group_forward import sample_after
from workers.training.supervised import Prompt, Target, demo_ids, item_prompt, item_target, supervised_logprobs

if TYPE_CHECKING:
    from workers.training.trainer import PolicyTrainer

log = get_logger(__name__)


def run_warmup(
    trainer: PolicyTrainer,
    items: Sequence[TaskItem],
    on_check: Callable[[dict[str, float]], None] | None = None,
    on_learned: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Supervised steps on (prompt, answer) until sampled accuracy reaches the target or max_steps.

    A high learning rate can reach a good accuracy and then collapse: when max_steps ends below the
    best accuracy seen at a check, the weights of that check are restored (every rank alike, as the
    accuracy is computed identically on each). With `label_noise` > 0, `noise_steps` more steps follow
    in which that fraction of the answers is replaced by wrong ones: the model keeps the task's format
    but loses its confidence, so RL starts from a weak, reproducible policy with a dense reward signal.
    `on_check` is told each accuracy check (step, loss, accuracy): the warm-up's progress. `on_learned` is called
    once the clean steps are done (the best check restored), before the noisy ones: the model then reads the task
    best.
    """
    wcfg = trainer.cfg.warmup
    tok = trainer.tokenizer
    examples: list[tuple[Prompt, Target]] = [
        (item_prompt(trainer, it), item_target(tok, it)) for it in items if it.answer is not None or it.demos
    ]
    noisy: list[tuple[Target, ...]] = [
        tuple(demo_ids(tok, d) for d in it.demos[1:]) for it in items if it.answer is not None or it.demos
    ]
    if wcfg.max_steps == 0 or not examples:
        return {"warmup_steps": 0.0, "warmup_accuracy": float("nan")}
    model = trainer.model
    opt = torch.optim.AdamW(model.parameters(), lr=wcfg.lr)
    rng = random.Random(trainer.cfg.seed)
    accuracy = 0.0
    step = 0
    best: tuple[float, int, dict[str, torch.Tensor], dict[str, Any]] | None = None
    for step in range(1, wcfg.max_steps + 1):
        loss = _sft_step(trainer, opt, [examples[rng.randrange(len(examples))] for _ in range(wcfg.batch_size)])
        if step % wcfg.check_every == 0:
            accuracy = sampled_accuracy(trainer, items[:64])
            log.info("warmup_progress", step=step, loss=round(loss, 4), accuracy=round(accuracy, 3))
            if on_check is not None:
                on_check({"warmup_step": float(step), "warmup_loss": loss, "warmup_accuracy": accuracy})
            if accuracy >= wcfg.target_accuracy:
                break
            if best is None or accuracy > best[0]:
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
                best = (accuracy, step, weights, copy.deepcopy(opt.state_dict()))
    if best is not None and best[0] > accuracy:
        model.load_state_dict(best[2])
        opt.load_state_dict(best[3])  # the optimizer as it was at that check: its moments belong to those weights
        log.info("warmup_best_restored", step=best[1], accuracy=round(best[0], 3), final=round(accuracy, 3))
        accuracy = best[0]
    if on_learned is not None:
        on_learned()
    answers = [a for _, a in examples]
    for _ in range(wcfg.noise_steps if wcfg.label_noise > 0 else 0):
        chosen = []
        for _ in range(wcfg.batch_size):
            at = rng.randrange(len(examples))
            prompt, answer = examples[at]
            if rng.random() < wcfg.label_noise:  # a demonstrated mistake, or another item's answer
                answer = (
                    rng.choice(noisy[at]) if noisy[at] else rng.choice([a for a in answers if a != answer] or [answer])
                )
            chosen.append((prompt, answer))
        _sft_step(trainer, opt, chosen)
    if wcfg.label_noise > 0 and wcfg.noise_steps > 0:
        accuracy = sampled_accuracy(trainer, items[:64])
        log.info("warmup_noise_done", steps=wcfg.noise_steps, accuracy=round(accuracy, 3))
    return {"warmup_steps": float(step + wcfg.noise_steps), "warmup_accuracy": accuracy}


def _sft_step(trainer: PolicyTrainer, opt: torch.optim.Optimizer, chosen: Sequence[tuple[Prompt, Target]]) -> float:
    """One supervised step: mean token log-loss of the targets' trained tokens after their prompts."""
    logp, mask = supervised_logprobs(trainer, chosen)
    loss = -(logp * mask).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


@torch.no_grad()
def sampled_accuracy(trainer: PolicyTrainer, items: Sequence[TaskItem]) -> float:
    """Fraction of one temperature-1 sample per item that exactly matches the answer (then eos); for an item with
    demonstrations, whose first turn is the clean demonstration's first segment (the call, for a tool task)."""
    model, tok, device = trainer.model, trainer.tokenizer, trainer.device
    rollout = trainer.config.rollout
    model.eval()
    generator = torch.Generator().manual_seed(trainer.cfg.seed)
    try:
        eos = tok.eos_token_id
        if trainer.prompter is not None:  # a multimodal policy: every item in one batch per new token
            prompts = [item_prompt(trainer, it) for it in items]
            with trainer.autocast():
                answers = sample_after(model, prompts, rollout.max_new_tokens, rollout.temperature, generator, eos)
            hits = sum(
                stopped and tok.decode(out).strip() == (it.answer or "").strip()
                for it, (out, stopped) in zip(items, answers, strict=True)
            )
            return hits / max(1, len(items))
        hits = 0
        for it in items:
            ids = torch.tensor([item_prompt(trainer, it)[0]], device=device)
            out: list[int] = []
            first = it.demos[0][0][0] if it.demos else None
            for _ in range(rollout.max_new_tokens):
                with trainer.autocast():
                    logits = model(input_ids=ids, use_cache=False).logits[0, -1].float() / rollout.temperature
                # One generator seeded alike on every rank: FSDP ranks must take identical branches.
                token = int(torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator))
                if token == eos:
                    break
                out.append(token)
                ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
                if first is not None and len(tok.decode(out)) >= len(first):
                    break
            else:
                if first is None:
                    continue
            if first is not None:
                hits += tok.decode(out).startswith(first)
                continue
            hits += tok.decode(out).strip() == (it.answer or "").strip()
        return hits / max(1, len(items))
    finally:
        model.train()

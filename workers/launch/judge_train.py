"""`relax model judge-train CONFIG [--data LABELLED.jsonl] --out DIR`: a judge model trained on labelled pairs.

Each line of the data is `{"prompt": ..., "response": ..., "label": true|false}` (and optionally `"reference"`,
the task's answer). The run config's `judge` section says how the judge reads a sample (`template`, `yes_text`,
`no_text`, `prompt_format`); the judge learns to continue the filled template with the yes or the no text (plus its
EOS), by the supervised log-loss of those tokens only, each batch half right and half wrong pairs. A tenth of the
pairs (at most 512) is held out: every `check_every` steps the agreement of the judge's p(yes) >= 0.5 with the
labels on it is measured, and the weights of the best check (the untrained model included) are the ones written.
The output is a model directory like `relax export` writes, to be named as `judge.source`.

Without `--data`, the pairs come from the run's task, for tasks whose answers are whole numbers: each item's
answer (right) and `wrong_per_item` near misses (off by one, by ten, a digit changed: wrong). To retrain on
on-policy samples, label a run's samples and train again with `--base` the previous judge.
"""

from __future__ import annotations

import copy
import json
import random
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.config import PipelineConfig
from workers.config.judge import JudgeConfig
from workers.data.jsonl_task import jsonl_lines
from workers.data.model_build import install_build, staging_dir
from workers.data.task_items import TaskItem
from workers.data.tasks import prompt_text


@dataclass(frozen=True)
class Labelled:
    """One labelled pair: a prompt, a response, the task's answer (or None) and whether the response is right."""

    prompt: str
    response: str
    reference: str | None
    label: bool


def read_labelled(path: Path) -> list[Labelled]:
    """The pairs of a JSON Lines file; ValueError naming the first bad line (and the file) otherwise."""
    if not path.is_file():
        raise ValueError(f"labelled data {path} is not a file")
    pairs = []
    for number, line in jsonl_lines(path, "labelled data"):
        try:
            row = json.loads(line)
            pair = Labelled(str(row["prompt"]), str(row["response"]), row.get("reference"), row["label"])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{number}: not a labelled pair ({err.__class__.__name__}: {err})") from None
        if not isinstance(pair.label, bool):
            raise ValueError(f"{path}:{number}: label must be true or false, got {pair.label!r}")
        pairs.append(pair)
    if len(pairs) < 10:
        raise ValueError(f"labelled data {path} has {len(pairs)} pairs: a judge needs at least 10")
    return pairs


def task_pairs(items: Sequence[TaskItem], wrong_per_item: int = 4, seed: int = 0) -> list[Labelled]:
    """Labelled pairs from task items whose answers are whole numbers: the answer (right) and near misses (wrong);
    ValueError when an item's answer is not one."""
    rng = random.Random(seed)
    pairs = []
    for item in items:
        answer = (item.answer or "").strip()
        if not answer.lstrip("-").isdigit():
            raise ValueError(f"task pairs need whole-number answers; an item's answer is {item.answer!r}: give --data")
        value = int(answer)
        question = prompt_text(item.parts)
        pairs.append(Labelled(question, answer, answer, True))
        misses = {value + d for d in (-10, -1, 1, 10)} | {int(_changed_digit(answer, rng))}
        misses.discard(value)
        for wrong in rng.sample(sorted(misses), min(wrong_per_item, len(misses))):
            pairs.append(Labelled(question, str(wrong), answer, False))
    return pairs


def _changed_digit(answer: str, rng: random.Random) -> str:
    digits = list(answer)
    spots = [i for i, c in enumerate(digits) if c.isdigit()]
    i = rng.choice(spots)
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
    return "".join(digits)


def train_judge(
    config: PipelineConfig,
    data: Path | None,
    out: Path,
    base: str | None = None,
    steps: int = 800,
    lr: float = 3e-3,
    batch_size: int = 64,
    check_every: int = 50,
    on_check: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Train a judge on the pairs in `data` (None: `task_pairs` of the run's task) as `config.judge` reads samples,
    starting from `base` (default: the run's `model.source`), and write it to `out` (created; refused when it holds
    files). Returns the record written beside the weights: base, pairs, steps, the held-out agreement and its share
    of yes labels."""
    import torch

    from workers.data.models import as_source, load_model, load_tokenizer, materialize
    from workers.rewards.judge import Judge, judge_prompt
    from workers.training.logprobs import token_logprobs
    from workers.training.supervised import sft_tensors

    if config.judge is None:
        raise ValueError("the config has no judge section: it says how the judge reads a sample")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty")
    cfg: JudgeConfig = config.judge
    if data is not None:
        pairs = read_labelled(data)
    else:
        from workers.config import task_spec
        from workers.data.tasks import load_task

        pairs = task_pairs(load_task(task_spec(config.task)), seed=config.trainer.seed)
    rng = random.Random(config.trainer.seed)
    rng.shuffle(pairs)
    held = min(512, max(1, len(pairs) // 10))
    test, train = pairs[:held], pairs[held:]
    source = as_source(base) if base is not None else config.model.source
    with tempfile.TemporaryDirectory(prefix="relax-judge-") as scratch:
        model_dir = materialize(source, Path(scratch) / "base", config.model.seed)
        torch.manual_seed(config.trainer.seed)
        model, tokenizer = load_model(model_dir).train(), load_tokenizer(model_dir)
        judge = Judge(model, tokenizer, cfg)
        verdicts = {True: tokenizer.encode(cfg.yes_text, add_special_tokens=False)}
        verdicts[False] = tokenizer.encode(cfg.no_text, add_special_tokens=False)

        def row(pair: Labelled) -> tuple[list[int], tuple[list[int], list[int]]]:
            prompt = judge.ids(judge_prompt(cfg.template, pair.prompt, pair.response, pair.reference))
            target = [*verdicts[pair.label], int(tokenizer.eos_token_id)]
            return prompt, (target, [1] * len(target))

        right, wrong = [row(p) for p in train if p.label], [row(p) for p in train if not p.label]
        if not right or not wrong:
            raise ValueError("the labelled pairs must hold right and wrong ones: a judge learns to tell them apart")
        texts = [judge_prompt(cfg.template, p.prompt, p.response, p.reference) for p in test]

        def agreement() -> float:
            model.eval()
            scores = judge.judge(texts)
            model.train()
            right = sum(((j.score or 0.0) >= 0.5) == p.label for j, p in zip(scores, test, strict=True))
            return right / len(test)

        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        best: tuple[float, int, dict[str, torch.Tensor]] = (agreement(), 0, copy.deepcopy(model.state_dict()))
        for step in range(1, steps + 1):
            chosen = [rng.choice(right if k % 2 else wrong) for k in range(batch_size)]
            ids, attention, mask = sft_tensors(chosen)
            logp = token_logprobs(model, ids, attention)
            loss = -(logp * mask).sum() / mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % check_every == 0 or step == steps:
                agreed = agreement()
                if on_check is not None:
                    on_check({"step": float(step), "loss": float(loss.detach()), "agreement": agreed})
                if agreed > best[0]:
                    best = (agreed, step, copy.deepcopy(model.state_dict()))
        model.load_state_dict(best[2])
        staging = staging_dir(out)
        model.eval().save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
    record = {
        "source": "judge-train",
        "base": source.shorthand(),
        "data": str(data) if data is not None else f"task {config.task.type}",
        "pairs": len(pairs),
        "held_out": held,
        "held_out_yes": sum(p.label for p in test) / held,
        "steps": steps,
        "best_step": best[1],
        "agreement": best[0],
        "template": cfg.template,
    }
    install_build(staging, out, record)
    return record

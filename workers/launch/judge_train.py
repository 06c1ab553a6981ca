"""`relax model judge-train CONFIG [--data LABELLED.jsonl | --task-pairs] --out DIR`: a judge model trained on
labelled pairs.

The data (`workers.launch.judge_data`): by default, on-policy samples of CONFIG's policy along its warm-up, labelled
by the rule (`judge.check`, else the task's reward); with `--data`, a JSON Lines file of `{"prompt": ...,
"response": ..., "label": true|false}` (and optionally `"reference"`, the task's answer); with `--task-pairs`, each
task item's answer and near misses. The run config's `judge` section says how the judge reads a sample (`template`,
`yes_text`, `no_text`, `prompt_format`); the judge learns to continue the filled template with the yes or the no
text (plus its EOS), by the supervised log-loss of those tokens only, each batch half right and half wrong pairs
(so a rare label weighs as much as a common one and p(yes) = 0.5 stays the boundary). A tenth of the pairs (at most
1,024) is held out: every `check_every` steps the agreement of the judge's p(yes) >= 0.5 with the labels on it is
measured; training stops after `patience` checks without a better one once a check has beaten the untrained judge
(or at full agreement), and the weights of the best check (the untrained model included) are the ones written. The
output is a model directory like `relax export` writes, to be named as `judge.source`.
"""

from __future__ import annotations

import copy
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.config import PipelineConfig
from workers.config.judge import JudgeConfig
from workers.data.model_build import install_build, staging_dir
from workers.launch.judge_data import Labelled, policy_pairs, read_labelled, task_pairs

HELD_OUT_MAX = 1024
"""Most pairs held out to measure the agreement on."""


def labelled_pairs(
    config: PipelineConfig,
    data: Path | None,
    from_task: bool = False,
    on_sampled: Callable[[dict[str, float]], None] | None = None,
) -> tuple[list[Labelled], str]:
    """The pairs to train on and where they came from: `data`'s, the task's near misses (`from_task`), or on-policy
    samples of `config`'s policy (`workers.launch.judge_data.policy_pairs`)."""
    if data is not None:
        return read_labelled(data), str(data)
    if from_task:
        from workers.config import task_spec
        from workers.data.tasks import load_task

        return task_pairs(load_task(task_spec(config.task)), seed=config.trainer.seed), f"task {config.task.type}"
    pairs = policy_pairs(config, on_sampled=on_sampled)
    return pairs, f"samples of {config.model.source.shorthand()} along its warm-up, labelled by the rule"


def train_judge(
    config: PipelineConfig,
    pairs: list[Labelled],
    out: Path,
    base: str | None = None,
    steps: int = 1500,
    lr: float = 3e-3,
    batch_size: int = 64,
    check_every: int = 50,
    patience: int = 8,
    origin: str = "",
    on_check: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Train a judge on `pairs` as `config.judge` reads samples, starting from `base` (default: the run's
    `model.source`), for at most `steps` steps (fewer when `patience` checks in a row bring no better held-out
    agreement, or one reaches 1.0), and write the best check's weights to `out` (created; refused when it holds
    files). Returns the record written beside the weights: base, pairs and their share of right ones, steps run,
    the held-out agreement and its share of yes labels; `origin` says where the pairs came from."""
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
    pairs = list(pairs)
    rng = random.Random(config.trainer.seed)
    rng.shuffle(pairs)
    held = min(HELD_OUT_MAX, max(1, len(pairs) // 10))
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
            agreed = sum(((j.score or 0.0) >= 0.5) == p.label for j, p in zip(scores, test, strict=True))
            return agreed / len(test)

        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        best: tuple[float, int, dict[str, torch.Tensor]] = (agreement(), 0, copy.deepcopy(model.state_dict()))
        step, stale = 0, 0
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
                # Patience counts from the first check that beats the untrained judge: from random weights a judge
                # sits at the majority label for a few hundred steps before it starts to tell answers apart.
                stale = stale + 1 if agreed <= best[0] and best[1] > 0 else 0
                if agreed > best[0]:
                    best = (agreed, step, copy.deepcopy(model.state_dict()))
                if stale >= patience or best[0] >= 1.0:
                    break
        model.load_state_dict(best[2])
        staging = staging_dir(out)
        model.eval().save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
    record = {
        "source": "judge-train",
        "base": source.shorthand(),
        "data": origin,
        "pairs": len(pairs),
        "right_share": sum(p.label for p in pairs) / len(pairs),
        "held_out": held,
        "held_out_yes": sum(p.label for p in test) / held,
        "steps": step,
        "best_step": best[1],
        "agreement": best[0],
        "template": cfg.template,
    }
    install_build(staging, out, record)
    return record

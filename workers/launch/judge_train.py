"""`relax model judge-train CONFIG [--data LABELLED.jsonl | --task-pairs | --samples RUN/samples.jsonl] --out DIR`:
a judge model trained on labelled pairs.

The data (`workers.launch.judge_data`): by default, on-policy samples of CONFIG's policy along its warm-up, labelled
by the rule (`judge.check`, else the task's reward), and contrast pairs (every item against the policy's commonest
responses); with `--data`, a JSON Lines file of `{"prompt": ..., "response": ..., "label": true|false}` (and
optionally `"reference"`, the task's answer); with `--task-pairs`, each task item's answer and near misses; with
`--samples`, the samples runs logged, labelled by the rule, and their contrasts: the run's judge retrained on the
answers the policy gave under RL, those it was gamed by included, while every item is still set against the
commonest ones (a retrain on the logged samples alone closed the hole the policy had found and opened another). The
judge starts from `--base`, else, with `--samples`, from CONFIG's `judge.source` (the judge the run used), else,
with on-policy data and a warm-up, from the policy at the end of its warm-up's clean steps (it reads the task then:
on the demo it learned to verify answers where a judge from random weights, or from the policy after the noisy
steps, did not), else from CONFIG's `model.source`.

The run config's `judge` section says how the judge reads a sample (`template`, `yes_text`, `no_text`,
`prompt_format`); the judge learns to continue the filled template with the yes or the no text (plus its EOS), by
the supervised log-loss of those tokens only, each batch half right and half wrong pairs (so a rare label weighs as
much as a common one and p(yes) = 0.5 stays the boundary), the learning rate decaying to a tenth along a cosine. A
tenth of the pairs (at most 1,024) is held out, a pair given several times wholly in or out: every `check_every`
steps the judge's balanced agreement with the labels on it is measured; training stops at full agreement, or after
`patience` checks without a better one when given, and the weights of the best check (the untrained model included)
are the ones written. The output is a model directory like `relax export` writes, to be named as `judge.source`.
"""

from __future__ import annotations

import copy
import math
import random
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from workers.config import PipelineConfig
from workers.config.judge import JudgeConfig
from workers.config.model_source import AnySource
from workers.data.model_build import install_build, staging_dir
from workers.launch.judge_data import (
    Labelled,
    logged_pairs,
    policy_pairs,
    read_labelled,
    task_pairs,
)
from workers.launch.judge_defaults import JUDGE_TRAINING

HELD_OUT_MAX = 1024
"""Most pairs held out to measure the agreement on (a pair given several times counts as often)."""


def labelled_pairs(
    config: PipelineConfig,
    data: Path | None,
    from_task: bool = False,
    on_sampled: Callable[[dict[str, float]], None] | None = None,
    contrasts: int = 30,
    warmed: Path | None = None,
    samples: Sequence[Path] = (),
) -> tuple[list[Labelled], str]:
    """The pairs to train on and where they came from: `data`'s, the task's near misses (`from_task`), the samples
    of runs' `samples` logs, or on-policy samples of `config`'s policy with `contrasts` contrast pairs
    (`workers.launch.judge_data.policy_pairs`, which writes the policy at the end of its warm-up's clean steps to
    `warmed` when given)."""
    if data is not None:
        return read_labelled(data), str(data)
    if samples:
        pairs, n = logged_pairs(config, samples, contrasts)
        said = f"{n['judge_said_yes']} of {n['judged_wrong']}" if n["judged_wrong"] else "none of the"
        skipped = n["failed"] + n["clipped"] + n["foreign"]
        origin = (
            f"the samples of {', '.join(str(p) for p in samples)}, labelled by the rule ({n['distinct']} distinct "
            f"of {n['logged']} logged; {skipped} skipped: failed, clipped or not "
            f"items of the task; the run's judge said yes to {said} wrong ones)"
        )
        if more := len(pairs) - (n["logged"] - skipped):
            origin += f", with {more} contrasts of its {contrasts} commonest responses"
        return pairs, origin
    if from_task:
        from workers.config import task_spec
        from workers.data.tasks import load_task

        return task_pairs(load_task(task_spec(config.task)), seed=config.trainer.seed), f"task {config.task.type}"
    pairs = policy_pairs(config, on_sampled=on_sampled, contrasts=contrasts, warmed=warmed)
    origin = f"samples of {config.model.source.shorthand()} along its warm-up, labelled by the rule"
    return pairs, origin + (f", with contrasts of its {contrasts} commonest responses" if contrasts else "")


def build_judge(
    config: PipelineConfig,
    out: Path,
    data: Path | None = None,
    from_task: bool = False,
    base: str | None = None,
    contrasts: int = 30,
    on_sampled: Callable[[dict[str, float]], None] | None = None,
    samples: Sequence[Path] = (),
    **training: Any,
) -> dict[str, Any]:
    """`relax model judge-train`: the pairs (`labelled_pairs`), then `train_judge` from `base`, else from the run's
    judge (`judge.source`) when retraining it on logged `samples`, else from the policy at the end of its warm-up's
    clean steps (on-policy data with a warm-up), else from `model.source`. `training`: `train_judge`'s keywords.
    Returns the record written beside the judge's weights."""
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty")  # before minutes of sampling
    if contrasts < 0:
        raise ValueError(f"contrasts must be >= 0, got {contrasts}")
    if config.judge is None:
        raise ValueError("the config has no judge section: it says how the judge reads a sample")
    with tempfile.TemporaryDirectory(prefix="relax-judge-policy-") as scratch:
        warmed = Path(scratch) / "policy"
        pairs, origin = labelled_pairs(config, data, from_task, on_sampled, contrasts, warmed, samples)
        named, seed = None, None
        if base is None and samples:
            source = config.judge.source
            base, named, seed = source, f"the run's judge ({source.shorthand()})", config.judge.seed
        elif base is None and (warmed / "config.json").is_file():
            base, named = str(warmed), f"{config.model.source.shorthand()} after its warm-up's clean steps"
        return train_judge(config, pairs, out, base, origin=origin, base_name=named, seed=seed, **training)


def agreement(said_yes: list[bool], labels: list[bool]) -> dict[str, float]:
    """A judge's yes/no against the labels: the share it agrees on, the balanced agreement (the mean of its yes-rate
    on right pairs and its no-rate on wrong ones; the plain share when one label is missing) and its false-positive
    rate (yes on wrong pairs; 0 without any)."""
    agreed = sum(s == label for s, label in zip(said_yes, labels, strict=True)) / len(labels)
    on_right = [s for s, label in zip(said_yes, labels, strict=True) if label]
    on_wrong = [s for s, label in zip(said_yes, labels, strict=True) if not label]
    fp = sum(on_wrong) / len(on_wrong) if on_wrong else 0.0
    balanced = (sum(on_right) / len(on_right) + 1 - fp) / 2 if on_right and on_wrong else agreed
    return {"agreement": agreed, "balanced_agreement": balanced, "false_positive_rate": fp}


def held_out(pairs: Sequence[Labelled], rng: random.Random) -> tuple[list[Labelled], list[Labelled]]:
    """(held out, trained on): about a tenth of `pairs` (at most `HELD_OUT_MAX`) held out, whole distinct pairs at a
    time, so a pair given several times (a policy repeats its answers) is never both trained on and checked."""
    by_pair: dict[Labelled, list[Labelled]] = {}
    for pair in pairs:
        by_pair.setdefault(pair, []).append(pair)
    distinct = list(by_pair)
    rng.shuffle(distinct)
    want = min(HELD_OUT_MAX, max(1, len(pairs) // 10))
    test: list[Labelled] = []
    train: list[Labelled] = []
    for pair in distinct:
        copies = by_pair[pair]
        (test if len(test) < want and len(test) + len(copies) <= HELD_OUT_MAX else train).extend(copies)
    if not train:  # one distinct pair in all: it is trained on
        train, test = test, []
    return test, train


def train_judge(
    config: PipelineConfig,
    pairs: list[Labelled],
    out: Path,
    base: AnySource | str | None = None,
    steps: int = int(JUDGE_TRAINING["steps"]),
    lr: float = JUDGE_TRAINING["lr"],
    batch_size: int = 64,
    check_every: int = 50,
    patience: int | None = None,
    origin: str = "",
    on_check: Callable[[dict[str, float]], None] | None = None,
    base_name: str | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """Train a judge on `pairs` as `config.judge` reads samples, starting from `base` (a model source; default: the
    run's `model.source`; `seed`: a source built in code is built with it, default `model.seed`), for `steps` steps
    with the learning rate's cosine decay to a tenth (fewer when `patience` checks in a row bring no better held-out
    agreement, or one is perfect), and write the best check's weights to `out` (created; refused when it holds
    files). Checks are compared by their balanced agreement, the mean of the judge's yes-rate on right pairs and its
    no-rate on wrong ones: with mostly wrong pairs held out, a judge saying no to everything would otherwise look
    good. Returns the record written beside the weights: base, pairs and their
    share of right ones, steps run, the best check's agreement, balanced agreement and false-positive rate (yes on
    wrong pairs), and the held-out share of yes labels; `origin` says where the pairs came from, `base_name` what
    the base is when its path says nothing (a scratch directory)."""
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
    rng = random.Random(config.trainer.seed)
    test, train = held_out(pairs, rng)
    held = len(test)
    source = as_source(base) if base is not None else config.model.source
    with tempfile.TemporaryDirectory(prefix="relax-judge-") as scratch:
        model_dir = materialize(source, Path(scratch) / "base", config.model.seed if seed is None else seed)
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
        if not test:
            raise ValueError(f"no pair can be held out: each is given more than {HELD_OUT_MAX} times")
        texts = [judge_prompt(cfg.template, p.prompt, p.response, p.reference) for p in test]

        def check() -> dict[str, float]:
            model.eval()
            scores = judge.judge(texts)
            model.train()
            return agreement([(j.score or 0.0) >= 0.5 for j in scores], [p.label for p in test])

        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.1 + 0.45 * (1 + math.cos(math.pi * k / steps)))
        first = check()
        if on_check is not None:
            on_check({"step": 0.0, "loss": math.nan, **first})  # the base, as the held-out pairs find it
        best: tuple[dict[str, float], int, dict[str, torch.Tensor]] = (first, 0, copy.deepcopy(model.state_dict()))
        step, stale = 0, 0
        for step in range(1, steps + 1):
            chosen = [rng.choice(right if k % 2 else wrong) for k in range(batch_size)]
            ids, attention, mask = sft_tensors(chosen)
            logp = token_logprobs(model, ids, attention)
            loss = -(logp * mask).sum() / mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            decay.step()
            if step % check_every == 0 or step == steps:
                checked = check()
                if on_check is not None:
                    on_check({"step": float(step), "loss": float(loss.detach()), **checked})
                # Patience counts from the first check that beats the untrained judge: from random weights a judge
                # sits at one label for a few hundred steps before it starts to tell answers apart.
                better = checked["balanced_agreement"] > best[0]["balanced_agreement"]
                stale = 0 if better or best[1] == 0 else stale + 1
                if better:
                    best = (checked, step, copy.deepcopy(model.state_dict()))
                if (patience is not None and stale >= patience) or best[0]["balanced_agreement"] >= 1.0:
                    break
        model.load_state_dict(best[2])
        staging = staging_dir(out)
        model.eval().save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
    record = {
        "source": "judge-train",
        "base": base_name or source.shorthand(),
        "data": origin,
        "pairs": len(pairs),
        "right_share": sum(p.label for p in pairs) / len(pairs),
        "held_out": held,
        "held_out_yes": sum(p.label for p in test) / held,
        "steps": step,
        "best_step": best[1],
        **best[0],
        "template": cfg.template,
    }
    install_build(staging, out, record)
    return record

"""A judge's labelled data (`relax model judge-train`): pairs read from a file, near misses of the task's answers,
on-policy samples of the run's own policy labelled by the rule, or the samples a run logged (to retrain its judge).

The judge is asked about the policy's samples, so it learns best from them: `policy_pairs` samples the config's
policy along its supervised warm-up (`trainer.warmup`) — at each accuracy check, from no format to mostly right, and
once after the noisy steps, where RL starts — and labels every sample with the rule. A judge trained on them meets,
in the run, the answers it was trained on; one trained on `task_pairs` (each item's one right answer and a few near
misses) must tell right from wrong on items whose right answer it may never have seen labelled. `contrast_pairs` then
sets every item against the answers the policy gives most often, as RL will try them.
"""

from __future__ import annotations

import json
import random
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from workers.config import PipelineConfig
from workers.data.jsonl_task import jsonl_lines
from workers.data.task_items import TaskItem
from workers.data.tasks import prompt_text

if TYPE_CHECKING:
    from workers.rewards.scorer import Scorer


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


def logged_pairs(
    config: PipelineConfig, paths: Sequence[Path], contrasts: int = 0
) -> tuple[list[Labelled], dict[str, int]]:
    """Every sample of runs' samples logs (`samples.jsonl`) as a pair labelled by CONFIG's rule (`judge.check`, else
    the task's reward) against its item's answer, found by the prompt's text among CONFIG's task items: the answers
    the policy gave as RL went, which a judge trained before the run may not have seen. A pair logged n times is
    there n times: what the policy repeats (a wrong answer the judge let through, above all) weighs as often as it
    was tried.

    Skipped and counted: samples whose reward failed (`error`), whose prompt or response the log clipped, and whose
    prompt is not an item of CONFIG's task. With `contrasts` > 0, `contrast_pairs` of them follow, labelled by the
    same rule. The counts also give the distinct pairs, and how often the run's judge said yes (`verdict` >= 0.5) to
    a sample the rule calls wrong. ValueError, naming the file and line, on a line
    that is not a logged sample, and when no sample is left."""
    from workers.config import task_spec
    from workers.data.tasks import load_task
    from workers.roles.step_samples import MARK

    answers = {prompt_text(item.parts): item.answer for item in load_task(task_spec(config.task))}
    counts = dict.fromkeys(("logged", "failed", "clipped", "foreign", "judged_wrong", "judge_said_yes"), 0)
    labelled: dict[tuple[str, str, str], Labelled] = {}
    pairs: list[Labelled] = []
    scorer = rule_scorer(config)
    try:
        for path in paths:
            if not path.is_file():
                raise ValueError(f"samples log {path} is not a file")
            for number, line in jsonl_lines(path, "samples log"):
                try:
                    row = json.loads(line)
                    prompt, response, verdict = str(row["prompt"]), str(row["response"]), row.get("verdict")
                    finish = str(row.get("finish_reason", "stop"))
                except (ValueError, KeyError, TypeError) as err:
                    problem = f"{err.__class__.__name__}: {err}"
                    raise ValueError(f"{path}:{number}: not a logged sample ({problem})") from None
                counts["logged"] += 1
                if row.get("error") is not None:
                    counts["failed"] += 1
                elif prompt.startswith(MARK) or response.endswith(MARK):
                    counts["clipped"] += 1
                elif prompt not in answers or answers[prompt] is None:
                    counts["foreign"] += 1
                else:
                    if (prompt, response, finish) not in labelled:
                        reference = answers[prompt]
                        labelled[prompt, response, finish] = Labelled(
                            prompt, response, reference, rule_says_right(scorer, response, reference, finish)
                        )
                    pairs.append(pair := labelled[prompt, response, finish])
                    if not pair.label and isinstance(verdict, int | float):
                        counts["judged_wrong"] += 1
                        counts["judge_said_yes"] += verdict >= 0.5
        if not pairs:
            named = ", ".join(str(p) for p in paths)
            raise ValueError(
                f"no usable sample in {named} ({counts['logged']} logged: {counts['failed']} failed, "
                f"{counts['clipped']} clipped, {counts['foreign']} not items of CONFIG's task): give the run's own "
                "config"
            )
        more = contrast_pairs(pairs, lambda r, ref: rule_says_right(scorer, r, ref), contrasts) if contrasts > 0 else []
    finally:
        scorer.close()
    return pairs + more, {**counts, "distinct": len(labelled)}


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


def rule_scorer(config: PipelineConfig) -> Scorer:
    """The rule a judge's pairs are labelled by: `judge.check` when the config sets one, else the task's rewards."""
    from workers.rewards.scorer import Scorer
    from workers.roles.reward import make_scorer_from

    check = config.judge.check if config.judge is not None else None
    return Scorer([check]) if check is not None else make_scorer_from(config)


def rule_says_right(scorer: Scorer, response: str, reference: str | None, finish_reason: str = "stop") -> bool:
    """Whether the rule scores `response` (ended as `finish_reason` says) right against `reference`: a reward of at
    least 0.5."""
    return scorer.score(response, reference, finish_reason).reward >= 0.5


def contrast_pairs(pairs: Sequence[Labelled], label: Callable[[str, str | None], bool], most: int) -> list[Labelled]:
    """Each item of `pairs` with the responses the policy gave most often, to any item: for every distinct (prompt,
    reference), the `most` commonest responses of `pairs`, the empty response and the reference itself (those it
    did not already give), each labelled by `label(response, reference)` (the rule).

    Sampled pairs hold, for an item, the few answers the policy happened to give it. Under RL the policy tries on an
    item the answers it gives to others, and a judge that never saw them there says yes to some of them: judges
    trained on the demo policy's warm-up samples alone said yes to 8-26 % of the wrong answers of the task set
    against its items (`benchmarks/judge_space.py`), and RL learned those. With every item set against the same
    answers, only the reference tells a right one from a wrong one."""
    common = [r for r, _ in Counter(p.response for p in pairs).most_common(most)]
    given = {(p.prompt, p.reference, p.response) for p in pairs}
    out = []
    for prompt, reference in sorted({(p.prompt, p.reference) for p in pairs}, key=str):
        for response in dict.fromkeys([*common, "", *([reference] if reference is not None else [])]):
            if (prompt, reference, response) not in given:
                out.append(Labelled(prompt, response, reference, label(response, reference)))
    return out


def policy_pairs(
    config: PipelineConfig,
    samples_per_item: int = 2,
    on_sampled: Callable[[dict[str, float]], None] | None = None,
    contrasts: int = 30,
    warmed: Path | None = None,
) -> list[Labelled]:
    """On-policy labelled samples: `config`'s policy (`model.source`) sampled along its warm-up at each accuracy
    check and once at its end (the weights RL starts from; once only without a warm-up), every task item x
    `samples_per_item` at the rollout's sampling settings, each sample labelled right when the rule scores it
    >= 0.5. The rule is `judge.check` when the config sets one, else the task's default reward (`exact` for
    addition). The response is the text the run's judge reads (`workers.roles.reward.scored_text`). With
    `contrasts` > 0, `contrast_pairs` of them follow (the `contrasts` commonest responses against every item, and
    the empty one and the reference), labelled by the same rule.

    `on_sampled` is told each round: its number, the warm-up step, the samples and the rule's accuracy on them.
    `warmed`: a directory to write the policy to at the end of the warm-up's clean steps (its best check, before
    any noisy steps), as a model directory: the base a judge learns fastest from, as it reads the task best then
    (none is written without a warm-up)."""
    import torch

    from schemas import RolloutGroup, WireTensor
    from workers.config import task_spec
    from workers.data.models import materialize
    from workers.data.prompts import prompt_ids
    from workers.data.tasks import load_task
    from workers.engines.base import SamplingSettings
    from workers.engines.torch_engine import TorchEngine
    from workers.roles.feeder import group_for
    from workers.roles.reward import score_group, scored_text
    from workers.roles.rollout import sample_of
    from workers.training.trainer import PolicyTrainer
    from workers.training.warmup import run_warmup

    items = load_task(task_spec(config.task))
    if not any(item.answer is not None for item in items):
        raise ValueError("policy samples are labelled by the rule against the task's answers: the task has none")
    scorer = rule_scorer(config)
    m, r = config.model, config.rollout
    sampling = SamplingSettings(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens)
    n = samples_per_item
    pairs: list[Labelled] = []
    try:
        with tempfile.TemporaryDirectory(prefix="relax-judge-data-") as scratch:
            base = materialize(config.model.source, Path(scratch) / "base", config.model.seed)
            trainer = PolicyTrainer(base, config)
            engine = TorchEngine(base)
            prompts = [group_for("judge-data", n, items, i, 0) for i in range(len(items))]
            ids = [
                prompt_ids(trainer.tokenizer, prompt_text(p.parts), m.prompt_format, m.system_prompt) for p in prompts
            ]

            def sample(step: float) -> None:
                round_ = len(pairs) // max(1, n * len(items))
                engine.load_state_dict(trainer.full_state(), round_)
                seeds = [(round_ * len(ids) + i) * n for i in range(len(ids))]
                outputs = engine.generate(ids, n, sampling, seeds=seeds)
                right = 0
                for prompt, prompt_ids_, out in zip(prompts, ids, outputs, strict=True):
                    group = RolloutGroup(
                        prompt=prompt,
                        prompt_token_ids=WireTensor.from_values(prompt_ids_, "int32"),
                        samples=tuple(sample_of(g) for g in out),
                        policy_version=round_,
                    )
                    scored = score_group(scorer, group)
                    question = prompt_text(prompt.parts)
                    for s, reward in zip(group.samples, scored.rewards, strict=True):
                        right += reward >= 0.5
                        pairs.append(Labelled(question, scored_text(engine.tokenizer, s), prompt.answer, reward >= 0.5))
                if on_sampled is not None:
                    total = n * len(ids)
                    on_sampled({"round": float(round_ + 1), "step": step, "samples": total, "accuracy": right / total})

            with torch.no_grad():
                sample(0.0)  # the untrained policy: what it says before it has the format
            if config.trainer.warmup.max_steps > 0:

                def learned() -> None:
                    if warmed is not None:
                        with torch.no_grad():
                            trainer.model.save_pretrained(warmed, safe_serialization=True)
                        trainer.tokenizer.save_pretrained(warmed)

                run_warmup(trainer, items, lambda fields: sample(fields["warmup_step"]), learned)
                sample(-1.0)  # the warm-up's end (after its noisy steps): where RL starts

        if contrasts > 0:
            pairs.extend(contrast_pairs(pairs, lambda response, ref: rule_says_right(scorer, response, ref), contrasts))
    finally:
        scorer.close()
    return pairs

"""The samples log's entries: a few of a step's trained samples, their texts clipped, for `Metric.samples`.

The actor picks them when it records a step; the metrics role writes them (`workers.metrics.samples`). The choice
is fixed by the groups: in release order, one sample of each group in turn (sample 0 of every group, then sample 1
of every group, ...), so a step's few samples show as many prompts as they can. The response is `Sample.text`, which
the reward role sets to the text it scored, decoded from the token ids (`workers.roles.reward.scored_text`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from schemas import PromptGroup, StepSample, TextPart, TrainGroup
from workers.data.tasks import prompt_text as parts_text
from workers.rewards.judge import judge_prompt
from workers.training.step_metrics import reward_terms

MARK = "…"
"""What stands for the clipped part of a text."""


def step_samples(
    groups: Sequence[TrainGroup], count: int, text_bytes: int, judge_template: str | None = None
) -> tuple[StepSample, ...]:
    """`count` samples of the step's `groups` (fewer when the step has fewer), texts within `text_bytes` bytes each;
    with `judge_template` (a run with a judge), each with the judge's prompt as that template renders it."""
    ordered = sorted(groups, key=lambda g: g.prompt.release_index)
    out = []
    for group, index in _round_robin(ordered):
        if len(out) == count:
            break
        out.append(logged(group, index, text_bytes, judge_template))
    return tuple(out)


def _round_robin(groups: Sequence[TrainGroup]) -> Iterator[tuple[TrainGroup, int]]:
    """(group, sample index): sample 0 of every group, then sample 1 of every group, and so on."""
    most = max((len(g.scored.rollout.samples) for g in groups), default=0)
    for index in range(most):
        for group in groups:
            if index < len(group.scored.rollout.samples):
                yield group, index


def logged(group: TrainGroup, index: int, text_bytes: int, judge_template: str | None = None) -> StepSample:
    """Sample `index` of `group` as the samples log shows it."""
    scored = group.scored
    sample = scored.rollout.samples[index]
    detail = scored.details[index] if scored.details else None
    error = detail.error if detail is not None else None
    judgements = scored.rollout.judgements
    asked = None
    if judge_template is not None:
        asked = judge_prompt(judge_template, parts_text(group.prompt.parts), sample.text, group.prompt.answer)
    return StepSample(
        group_id=group.group_id,
        index=index,
        policy_version=group.policy_version,
        prompt=clip_start(prompt_text(group.prompt), text_bytes),
        response=clip_end(sample.text, text_bytes),
        reward=scored.rewards[index],
        terms=reward_terms(detail.components) if detail is not None else {},
        error=None if error is None else clip_end(error, text_bytes),
        finish_reason=sample.finish_reason,
        tokens=sample.token_ids.numel,
        verdict=judgements[index].score if judgements is not None else None,
        checks=dict(detail.checks) if detail is not None else {},
        judge_prompt=None if asked is None else clip_start(asked, text_bytes),
    )


def prompt_text(prompt: PromptGroup) -> str:
    """The prompt as text: earlier turns (`role: content`), then its parts, a media part as `<image>` (its type)."""
    turns = [f"{turn.role}: {turn.content}" for turn in prompt.history]
    parts = [p.text if isinstance(p, TextPart) else f"<{p.type}>" for p in prompt.parts]
    return "\n".join([*turns, "".join(parts)])


def clip_end(text: str, max_bytes: int) -> str:
    """`text` within `max_bytes` UTF-8 bytes: its start and `MARK` when it is longer (whole characters only; a lone
    surrogate, which cannot go on the wire, as `?`)."""
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return data.decode("utf-8")
    return data[: max_bytes - len(MARK.encode())].decode("utf-8", "ignore") + MARK


def clip_start(text: str, max_bytes: int) -> str:
    """`text` within `max_bytes` UTF-8 bytes: `MARK` and its end when it is longer (as `clip_end`, from the end)."""
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return data.decode("utf-8")
    return MARK + data[len(data) - (max_bytes - len(MARK.encode())) :].decode("utf-8", "ignore")

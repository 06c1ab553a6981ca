"""The samples log as each sink shows it: the few trained samples a step's metric carries (`Metric.samples`, picked
and clipped by the actor: `workers.roles.step_samples`).

    samples.jsonl   one object per sample (`record`): step, at, group_id, index, policy_version, reward, terms,
                    verdict, checks, error, finish_reason, tokens, prompt, response, judge_prompt
    TensorBoard     a text `samples` at the step: every sample in Markdown (`markdown`)
    W&B             a table `samples` at the step (`TABLE_COLUMNS`, `table_rows`)
"""

from __future__ import annotations

import json
from typing import Any

from schemas import Metric, StepSample

TABLE_COLUMNS = (
    "step",
    "group_id",
    "index",
    "policy_version",
    "reward",
    "terms",
    "verdict",
    "checks",
    "error",
    "finish_reason",
    "tokens",
    "prompt",
    "response",
    "judge_prompt",
)
"""The fields of a logged sample, in the order samples.jsonl and the W&B table show them."""


def record(point: Metric, sample: StepSample) -> dict[str, Any]:
    """One line of samples.jsonl: the step, when it was recorded, and the sample's fields (`TABLE_COLUMNS` order)."""
    fields = sample.model_dump()
    return {"step": point.step, "at": point.at, **{k: fields[k] for k in TABLE_COLUMNS if k != "step"}}


def jsonl_lines(point: Metric) -> str:
    """The step's lines of samples.jsonl (UTF-8 as it is, not escaped); empty when it carries no samples."""
    return "".join(json.dumps(record(point, s), ensure_ascii=False) + "\n" for s in point.samples)


def table_rows(point: Metric) -> list[list[Any]]:
    """The step's rows of the W&B table (`TABLE_COLUMNS`; the terms and the checks as JSON objects)."""
    rows = []
    for sample in point.samples:
        fields = record(point, sample)
        rows.append([json.dumps(fields[c]) if c in ("terms", "checks") else fields[c] for c in TABLE_COLUMNS])
    return rows


def markdown(point: Metric) -> str:
    """The step's samples as one Markdown text (TensorBoard's text dashboard): a header line each, then the prompt
    and the response as indented blocks, which show any text as it is."""
    return "\n\n---\n\n".join(_sample_markdown(s) for s in point.samples)


def _sample_markdown(s: StepSample) -> str:
    terms = ", ".join(f"{name} {value:.3f}" for name, value in s.terms.items())
    head = (
        f"**group** {s.group_id} · sample {s.index} · **version** {s.policy_version} · **reward** {s.reward:.3f}"
        + (f" ({terms})" if terms else "")
        + f" · {s.finish_reason}, {s.tokens} tokens"
    )
    failed = [f"**reward failed**: {s.error}"] if s.error is not None else []
    checks = ", ".join(f"{name} {value:.3f}" for name, value in s.checks.items())
    judged = [] if s.verdict is None else [f"**judge** {s.verdict:.3f}" + (f" (checks: {checks})" if checks else "")]
    asked = [] if s.judge_prompt is None else ["**judge prompt**", _block(s.judge_prompt)]
    texts = ["**prompt**", _block(s.prompt), "**response**", _block(s.response), *asked]
    return "\n\n".join([head, *failed, *judged, *texts])


def _block(text: str) -> str:
    """`text` as an indented Markdown code block (no character in it is markup there)."""
    return "\n".join("    " + line for line in (text.splitlines() or [""]))

"""A task's items, and the one-message report of a dataset's bad rows that every loader gives."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from schemas import ChatTurn
from schemas.parts import Part

MAX_REPORTED_ERRORS = 20


Demo = tuple[tuple[str, bool], ...]
"""A demonstration for the supervised warm-up: text segments in order, each trained (True) or context (False: an
environment's observation), then EOS."""


@dataclass(frozen=True)
class TaskItem:
    """One problem of a task: the prompt parts, the reference answer and where it comes from."""

    parts: tuple[Part, ...]
    answer: str | None
    task: str
    """Task name; it names the default reward (see `workers.rewards.scorer.default_rewards`)."""
    index: int
    """Row of the dataset, 0-based, in the order returned."""
    history: tuple[ChatTurn, ...] = ()
    """Earlier turns of a conversation, before `parts` (the user's latest turn)."""
    demos: tuple[Demo, ...] = ()
    """Warm-up demonstrations of an agentic task: the first is clean, the others are what `label_noise` mixes in;
    empty: the warm-up trains on `answer`."""
    columns: Mapping[str, str | int | float | bool | None] = field(default_factory=dict)
    """The dataset row's other columns, carried with the prompt to the rewards (`PromptGroup.columns`)."""


def report_errors(where: str, unit: str, errors: list[tuple[int, str]]) -> str:
    """Every bad line or row of a dataset in one message (the first MAX_REPORTED_ERRORS of them)."""
    shown = "\n".join(f"  {unit} {n}: {msg}" for n, msg in errors[:MAX_REPORTED_ERRORS])
    more = f"\n  ... and {len(errors) - MAX_REPORTED_ERRORS} more" if len(errors) > MAX_REPORTED_ERRORS else ""
    return f"{where}: {len(errors)} bad {unit}(s):\n{shown}{more}"


def check_limit(task: str, limit: int | None) -> None:
    """Refuse a `limit` option below 1 (None keeps every item)."""
    if limit is not None and limit < 1:
        raise ValueError(f"{task}: limit must be at least 1, got {limit}")

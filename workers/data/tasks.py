"""Datasets as a registry: `load_task({"type": ..., **options})` returns the task's items in order.

Built-in types: `addition` and `reverse` (synthetic, verifiable, small enough for a tiny model),
`jsonl` (one prompt per line, with optional image/audio/video parts; `workers.data.jsonl_task`), `hf` (a
dataset through Hugging Face `datasets`: a parquet, JSON Lines, CSV or arrow file, a directory of them, a
`save_to_disk` directory, or a hub dataset id from the hub cache; with field mapping, and the row's other columns
carried to the rewards) and `omni` (image, audio and video questions generated in code:
`workers.omni.tasks.omni_task`).
Adding a type is one loader function plus one line in `TASKS`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import random
import string
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas import ChatTurn
from schemas.parts import Part, TextPart
from workers.config.paths import looks_like_hub_id
from workers.data.jsonl_task import jsonl
from workers.data.task_items import TaskItem, check_limit, report_errors

__all__ = ["TASKS", "TaskItem", "epoch_order", "jsonl", "load_task", "prompt_text"]


@functools.lru_cache(maxsize=4)
def epoch_order(count: int, epoch: int, seed: int | None) -> tuple[int, ...]:
    """The order of a dataset's `count` rows in pass `epoch`: as loaded in the first pass (a seeded task is
    shuffled once at load), then a fresh permutation per pass seeded by `(seed, epoch)`; no seed: as loaded."""
    order = list(range(count))
    if seed is not None and epoch > 0:
        random.Random(f"{seed}/{epoch}").shuffle(order)
    return tuple(order)


def prompt_text(parts: Iterable[Part], sep: str = "") -> str:
    """The text parts joined by `sep`: what a text-only model sees of the prompt."""
    return sep.join(p.text for p in parts if isinstance(p, TextPart))


def addition(
    seed: int | None = None, digits: int = 1, limit: int | None = None, template: str = "{a}+{b}=", offset: int = 0
) -> list[TaskItem]:
    """Every `a+b=` with a, b of `digits` digits (100 problems for one digit); shuffled when `seed` is set, then the
    first `offset` skipped and `limit` kept: `offset=80` after `limit=80` (same seed) is a disjoint held-out set.

    `template` words the prompt (`{a}` and `{b}` are the operands), e.g. for an instruct model
    "What is {a}+{b}? Answer with just the number."."""
    try:
        template.format(a=0, b=0)
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"addition: template {template!r} may only name {{a}} and {{b}}: {err}") from None
    if not 1 <= digits <= 3:
        raise ValueError(f"addition: digits must be 1, 2 or 3, got {digits}")
    check_limit("addition", limit)
    top = 10**digits
    pairs = [(a, b) for a in range(top) for b in range(top)]
    if seed is not None:
        random.Random(seed).shuffle(pairs)
    if offset >= len(pairs):
        raise ValueError(f"addition: offset {offset} skips every one of the {len(pairs)} problems")
    pairs = pairs[offset:][:limit]
    return [_text_item(template.format(a=a, b=b), str(a + b), "addition", i) for i, (a, b) in enumerate(pairs)]


def reverse(min_len: int = 3, max_len: int = 6, count: int = 100, seed: int = 0) -> list[TaskItem]:
    """`count` distinct random lowercase words; the prompt `rev:abc=` asks for the word reversed (`cba`)."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"reverse: need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if count < 1:
        raise ValueError(f"reverse: count must be at least 1, got {count}")
    capacity = sum(26**n for n in range(min_len, max_len + 1))
    if count > capacity:
        raise ValueError(f"reverse: only {capacity} distinct words of length {min_len}..{max_len}, asked {count}")
    rng = random.Random(seed)
    words: dict[str, None] = {}  # insertion-ordered set
    while len(words) < count:
        n = rng.randint(min_len, max_len)
        words["".join(rng.choices(string.ascii_lowercase, k=n))] = None
    return [_text_item(f"rev:{w}=", w[::-1], "reverse", i) for i, w in enumerate(words)]


_HF_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}


def hf(
    path: str | Path,
    split: str = "train",
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    template: str | None = None,
    answer_regex: str | None = None,
    task: str = "hf",
    seed: int | None = None,
    limit: int | None = None,
    messages_field: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    columns: list[str] | str = "all",
) -> list[TaskItem]:
    """Rows of a dataset as text prompts; every row that cannot be used is reported at once.

    `path` is a local file or directory, or a hub dataset id (`org/name`, at `revision`) materialised in the hub
    cache (`cache_dir`, default the Hugging Face cache) with `snapshot_download`.

    The prompt is `template.format(**row)` when a template is given, else the row's `prompt_field`; with
    `messages_field`, the row's conversation (a list of `{role, content}`): its last user turn is the prompt
    and the turns before it the history (turns after it are ignored). The answer is the row's `answer_field`
    (null: no answer), or the first group of `answer_regex` in it (GSM8K's `#### 18` is
    `answer_regex: "####\\s*(.+)"`). `seed` shuffles the rows once. Each item carries the row's other
    `columns` (`all`: those with a scalar value, or the ones named).
    """
    import re

    check_limit("hf", limit)
    rows = _hf_rows(_dataset_path(str(path), revision, cache_dir), split)
    used = {prompt_field, answer_field, messages_field} if template is None else {answer_field, messages_field}
    pattern = re.compile(answer_regex) if answer_regex else None
    items: list[TaskItem] = []
    errors: list[tuple[int, str]] = []
    for i, row in enumerate(rows):
        history: tuple[ChatTurn, ...] = ()
        try:
            if messages_field is not None:
                text, history = _hf_conversation(row, messages_field)
            else:
                text = _hf_prompt(row, prompt_field, template)
            answer = None if answer_field is None else _hf_answer(row, answer_field, pattern)
            extra = _hf_columns(row, columns, used)
        except ValueError as err:
            errors.append((i, str(err)))
            continue
        items.append(TaskItem((TextPart(text=text),), answer, task, len(items), history, columns=extra))
    if errors:
        raise ValueError(report_errors(f"{path} ({split})", "row", errors))
    if not items:
        raise ValueError(f"{path} ({split}): no rows")
    if seed is not None:
        order = list(range(len(items)))
        random.Random(seed).shuffle(order)
        items = [dataclasses.replace(items[j], index=k) for k, j in enumerate(order)]
    return items[:limit]


def _dataset_path(path: str, revision: str | None, cache_dir: str | Path | None) -> Path:
    """A local dataset path as it is; a hub dataset id (`org/name`, nothing of that name here) as its snapshot
    directory in the hub cache."""
    local = Path(path).expanduser()
    if local.exists() or not looks_like_hub_id(path):
        return local
    from workers.data.hub_snapshot import snapshot

    return snapshot(path, revision, cache_dir, repo_type="dataset")


def _hf_columns(row: dict[str, Any], columns: list[str] | str, used: set[str | None]) -> dict[str, Any]:
    """The row's columns carried to the rewards: `all` of its scalar ones but `used`, or the named ones (each
    required, and scalar)."""
    scalar = str | int | float | bool | None
    if columns == "all":
        return {k: v for k, v in row.items() if k not in used and isinstance(v, scalar)}
    if missing := [c for c in columns if c not in row]:
        raise ValueError(f"no column {', '.join(map(repr, missing))} (fields: {', '.join(row)}); fix `columns`")
    if wrong := [c for c in columns if not isinstance(row[c], scalar)]:
        raise ValueError(f"column {', '.join(map(repr, wrong))} is not text, a number, a bool or null")
    return {c: row[c] for c in columns}


def _hf_rows(path: Path, split: str) -> list[dict[str, Any]]:
    """The rows of a dataset file or directory, read offline; ValueError when it cannot be read."""
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local dataset never needs the hub
    import datasets

    datasets.disable_progress_bars()
    if not path.exists():
        raise ValueError(f"hf task: no dataset at {str(path)!r}")
    try:
        if path.is_dir() and any((path / name).is_file() for name in ("dataset_dict.json", "state.json")):
            loaded: Any = datasets.load_from_disk(str(path))
        elif path.is_dir():  # a directory of data files (a hub dataset's snapshot): `datasets` finds the splits
            loaded = datasets.load_dataset(str(path))
        else:
            kind = _HF_FORMATS.get(path.suffix.lower())
            if kind is None:
                known = ", ".join(sorted(_HF_FORMATS))
                raise ValueError(f"hf task: {path.name} is not a dataset file ({known}, or a save_to_disk directory)")
            loaded = datasets.load_dataset(kind, data_files={split: str(path)})
    except (OSError, FileNotFoundError, datasets.exceptions.DatasetGenerationError) as err:
        raise ValueError(f"hf task: {path} cannot be read: {err}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"hf task: {path} has no split {split!r} (splits: {', '.join(loaded)})")
        loaded = loaded[split]
    return list(loaded)


def _hf_prompt(row: dict[str, Any], field: str, template: str | None) -> str:
    if template is not None:
        try:
            return template.format(**row)
        except KeyError as err:
            raise ValueError(
                f"template names field {err.args[0]!r}, which the row lacks (fields: {', '.join(row)})"
            ) from None
    if field not in row:
        raise ValueError(f"no field {field!r} (fields: {', '.join(row)}); set prompt_field or template")
    value = row[field]
    if not isinstance(value, str) or not value:
        raise ValueError(f"field {field!r} must be non-empty text, got {type(value).__name__}")
    return value


def _hf_conversation(row: dict[str, Any], field: str) -> tuple[str, tuple[ChatTurn, ...]]:
    """The last user turn's text and the turns before it, from a column of `{role, content}` records."""
    if field not in row:
        raise ValueError(f"no field {field!r} (fields: {', '.join(row)}); set messages_field")
    value = row[field]
    if not isinstance(value, list) or not value:
        raise ValueError(f"field {field!r} must be a non-empty list of {{role, content}}, got {type(value).__name__}")
    turns, problems = [], []
    for k, turn in enumerate(value):
        try:
            turns.append(ChatTurn.model_validate(turn))
        except ValidationError as err:
            problems += [f"turn {k} {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
    if problems:
        raise ValueError(f"field {field!r}: {'; '.join(problems)}")
    last = max((k for k, t in enumerate(turns) if t.role == "user"), default=None)
    if last is None:
        raise ValueError(f"field {field!r} has no user turn to answer")
    if not turns[last].content:
        raise ValueError(f"field {field!r}: the last user turn is empty")
    return turns[last].content, tuple(turns[:last])


def _hf_answer(row: dict[str, Any], field: str, pattern: Any) -> str:
    if field not in row:
        raise ValueError(f"no field {field!r} (fields: {', '.join(row)}); set answer_field (null: no answer)")
    value = row[field]
    if value is None:
        raise ValueError(f"field {field!r} is null in this row (set answer_field: null for prompts without answers)")
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"field {field!r} must be text or a number, got {type(value).__name__}")
    if pattern is None:
        return value
    found = pattern.search(value)
    if found is None:
        raise ValueError(f"answer_regex {pattern.pattern!r} does not match {value[:60]!r}")
    return str(found.group(1) if found.groups() else found.group()).strip()


TASKS: dict[str, Callable[..., list[TaskItem]] | str] = {
    "addition": addition,
    "reverse": reverse,
    "jsonl": jsonl,
    "hf": hf,
    "omni": "workers.omni.tasks:omni_task",
    "arithmetic": "workers.data.tool_tasks:arithmetic",
}
"""Task loaders by `task.type`; a `module:function` one is imported when a run loads that task (`omni`: the media
stack only for it)."""


def load_task(spec: Mapping[str, Any]) -> list[TaskItem]:
    """Load the task whose loader `spec["type"]` names, with the other keys as its options."""
    options = dict(spec)
    kind = options.pop("type", None)
    entry = TASKS.get(kind) if isinstance(kind, str) else None
    if entry is None:
        raise ValueError(f"unknown task type {kind!r}; known types: {', '.join(sorted(TASKS))}")
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        entry = getattr(importlib.import_module(module), name)
    loader: Callable[..., list[TaskItem]] = entry
    try:
        inspect.signature(loader).bind(**options)
    except TypeError as err:
        raise ValueError(f"task {kind!r}: {err}") from None
    return loader(**options)


def _text_item(prompt: str, answer: str, task: str, index: int) -> TaskItem:
    return TaskItem(parts=(TextPart(text=prompt),), answer=answer, task=task, index=index)

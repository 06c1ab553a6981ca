"""The supervised dataset mixed into RL updates (`trainer.sft.dataset`): a JSONL file of prompts with their answers.

Each non-blank line is one example, in one of two forms:

    {"prompt": ..., "answer": "..."}      the `jsonl` task's line (`workers.data.jsonl_task`), its answer required
    {"messages": [{"role": ..., "content": ...}, ...]}
                                          a conversation ending in the assistant's answer: that last turn is the
                                          target, the user turn before it the prompt, the turns before that its
                                          history (earlier assistant turns are context, not trained)

Either way the example is a `TaskItem`, rendered like a task's prompt and trained like the warm-up's answer
(`workers.training.supervised`). Every bad line is reported at once, with its number.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas import ChatTurn
from schemas.parts import TextPart
from workers.data.jsonl_task import jsonl_lines, jsonl_media_root, parse_record
from workers.data.task_items import TaskItem, report_errors

TASK = "sft"
"""The task name of every example."""


def sft_items(path: str | Path) -> list[TaskItem]:
    """The examples of a JSONL file, in file order; ValueError (one message) for a file that cannot be read, has a bad
    line (every one listed) or no example."""
    file = Path(path)
    lines = jsonl_lines(file, "sft dataset")
    root = jsonl_media_root(file)
    items: list[TaskItem] = []
    errors: list[tuple[int, str]] = []
    for lineno, line in lines:
        try:
            items.append(_example(line, file.parent, root, len(items)))
        except ValueError as err:
            errors.append((lineno, str(err)))
    if errors:
        raise ValueError(report_errors(f"sft dataset {file}", "line", errors))
    if not items:
        raise ValueError(f"sft dataset {file}: no examples (the file has no non-blank line)")
    return items


def _example(line: str, base: Path, root: Path, index: int) -> TaskItem:
    """One line as an item; ValueError says what is wrong with it."""
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError:
        record = None  # parse_record says what is wrong with it
    if isinstance(record, dict) and "messages" in record:
        if "prompt" in record or "answer" in record:
            raise ValueError("give either 'messages' or 'prompt' and 'answer', not both")
        text, history, reply = conversation(record["messages"])
        return TaskItem((TextPart(text=text),), reply, TASK, index, history)
    parts, answer, _ = parse_record(line, base, root)
    if answer is None:
        raise ValueError("no 'answer' to train on")
    return TaskItem(parts, answer, TASK, index)


def conversation(messages: Any) -> tuple[str, tuple[ChatTurn, ...], str]:
    """A conversation's prompt (the user turn before the last), its history (the turns before that) and its answer
    (the last turn, the assistant's); ValueError says what is wrong with it."""
    if not isinstance(messages, list) or len(messages) < 2:
        raise ValueError("'messages' must be a list of at least a user turn and the assistant's answer")
    turns, problems = [], []
    for k, turn in enumerate(messages):
        try:
            turns.append(ChatTurn.model_validate(turn))
        except ValidationError as err:
            problems += [f"messages[{k}] {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
    if problems:
        raise ValueError("; ".join(problems))
    *history, prompt, answer = turns
    if answer.role != "assistant" or not answer.content:
        raise ValueError("the last message must be the assistant's answer, not empty")
    if prompt.role != "user":
        raise ValueError(f"the answer must follow a user message, not a {prompt.role!r} one")
    if history and history[-1].role == "user":
        raise ValueError("two user messages in a row before the answer: join them into one")
    return prompt.content, tuple(history), answer.content

"""User reward functions for the scorer tests; imported by the scorer's child process."""

from __future__ import annotations

import time


def good(completion: str, answer: str | None, finish_reason: str, bonus: float = 0.0) -> float:
    """1.0 (+bonus) when the completion contains the answer."""
    return float(answer is not None and answer in completion) + bonus


def raises(completion: str, answer: str | None, finish_reason: str) -> float:
    """Always fails."""
    raise ZeroDivisionError("user code divided by zero")


def hangs(completion: str, answer: str | None, finish_reason: str) -> float:
    """Sleeps far past any timeout when the completion says so, answers 1.0 otherwise."""
    if completion == "hang":
        time.sleep(1000)
    return 1.0


def picky(completion: str, answer: str | None, finish_reason: str) -> float:
    """Raises on "boom", hangs on "hang", else 1.0 when the completion is the answer."""
    if completion == "boom":
        raise ValueError("cannot score 'boom'")
    if completion == "hang":
        time.sleep(1000)
    return float(completion == answer)


def components(completion: str, answer: str | None, finish_reason: str) -> dict[str, float]:
    """Two named parts: correctness and brevity."""
    return {"correct": float(completion.strip() == answer), "short": 0.5 if len(completion) < 5 else 0.0}


def not_a_number(completion: str, answer: str | None, finish_reason: str) -> str:
    """Returns the wrong type."""
    return "high"


NOT_CALLABLE = 3


def length_credit(completion: str, answer: str | None, finish_reason: str) -> float:
    """Longer completions score more: a signal an untrained model already varies on."""
    return len(completion) / 8.0


def tool_value(completion: str, answer: str | None, finish_reason: str) -> object:
    """A tool's result of the kind the completion names: JSON (`list`) or not (`set`, `nan`)."""
    return {"list": [1, "a", None, {"b": True}], "set": {1}, "nan": float("nan")}[completion]


def with_prompt(completion: str, answer: str | None, finish_reason: str, prompt: str, difficulty: int) -> float:
    """The per-sample form asking for the prompt and a column: 1.0 when the completion repeats the prompt's last
    word, scaled by the difficulty column."""
    return float(completion == prompt.split()[-1]) * difficulty


def batch_length(completions: list[str], prompts: list[str], answers: list[str | None], **columns: list) -> list[float]:
    """The batched form: each completion's length divided by its `scale` column (a check that columns arrive as
    lists, one value per completion)."""
    assert all(len(v) == len(completions) for v in columns.values()), columns
    assert len(prompts) == len(answers) == len(completions)
    return [len(c) / columns["scale"][i] for i, c in enumerate(completions)]


def batch_short(completions: list[str], prompts: list[str], answers: list[str | None]) -> list[float]:
    """Returns one value too few: a failure of every sample of the group."""
    return [1.0] * (len(completions) - 1)


def batch_hangs(completions: list[str], prompts: list[str], answers: list[str | None]) -> list[float]:
    """Sleeps far past any timeout."""
    time.sleep(1000)
    return [1.0] * len(completions)

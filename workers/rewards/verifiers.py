"""Math answer verification, run in the reward worker's child process (math-verify times out by signals,
which work only in a process's main thread).

    math(completion, answer, finish_reason, extract)   1.0 when the extracted answer equals the reference
                                                        mathematically (math-verify: 1/2 = 0.5 = \\frac{1}{2})

`extract` says what of the completion is the model's answer:
    boxed        the last `\\boxed{...}`; none scores 0 (the format is part of the task)
    last_number  the last number in the text (GSM8K's convention)
    auto         math-verify's own extraction: a `\boxed{}` first, else the last LaTeX or plain expression
                 (so "17 or 18" reads as 18)
A reference that math-verify cannot parse raises, so the sample scores 0 with the reason recorded.
math-verify's own timeouts (5 s to parse, 5 s to compare) apply; the scorer's `timeout_s` bounds the call.
"""

from __future__ import annotations

import re
from typing import Any

EXTRACTIONS = ("auto", "boxed", "last_number")
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def last_number(text: str) -> str | None:
    """The last number in the text, thousands separators removed, or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def math_answer(completion: str, answer: str | None, finish_reason: str, extract: str = "auto") -> float:
    """1.0 when the completion's answer (see `extract`) equals `answer` mathematically."""
    from math_verify import parse, verify

    if answer is None:
        raise ValueError("math reward needs a reference answer")
    if extract not in EXTRACTIONS:
        raise ValueError(f"unknown extract {extract!r}; valid: {list(EXTRACTIONS)}")
    gold = parse(_as_latex(answer))
    if not gold:
        raise ValueError(f"the reference answer {answer!r} is not a mathematical expression math-verify reads")
    if extract == "auto":
        predicted: Any = parse(completion)
    else:
        found = last_boxed(completion) if extract == "boxed" else last_number(completion)
        if found is None:
            return 0.0
        predicted = parse(_as_latex(found))
    return float(bool(predicted) and verify(gold, predicted))


def _as_latex(text: str) -> str:
    """A bare answer as inline LaTeX, so that math-verify reads `1/2` and `\\frac{1}{2}` alike."""
    stripped = text.strip()
    return stripped if stripped.startswith("$") or "\\boxed" in stripped else f"${stripped}$"

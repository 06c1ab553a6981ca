"""A reward for the dynamic-sampling runs: constant for most prompts, so most groups are uniform."""

from __future__ import annotations

import zlib


def informative(answer: str | None) -> bool:
    """Whether a prompt's samples are scored apart: one answer in four (an addition task's answer is a number)."""
    return answer is not None and int(answer) % 4 == 0


def mostly_constant(completion: str, answer: str | None, finish_reason: str) -> float:
    """0.5 for three prompts in four, whatever the completion (every sample of such a group scores the same);
    for the others a digest of the completion, which differs between the samples of an untrained model."""
    if not informative(answer):
        return 0.5
    return zlib.crc32(completion.encode()) % 997 / 997

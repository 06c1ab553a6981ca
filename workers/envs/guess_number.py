"""The `guess_number` environment: find a secret integer in `low..high` from `higher` / `lower` hints.

The secret is the prompt group's `metadata["secret"]` when it has one, otherwise drawn from
`random.Random(item.seed)`, so a replay of the episode meets the same secret. Each call is one guess:

    observation   reward   done
    higher        None     False   the secret is larger than the guess
    lower         None     False   the secret is smaller
    correct       1.0      True
    <hint> ...    0.0      True    the `max_guesses`-th wrong guess: the hint, then the secret
    error: ...    None     False   not an integer (not counted as a guess; `info["valid"]` is False)

So an episode's environment reward (`agent.reward: env`) is its final reward: 1 when found, 0 otherwise.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from workers.envs.base import EnvItem, StepResult, call_argument

_INTEGER = re.compile(r"[-+]?\d{1,30}")


class GuessNumber:
    """A number-guessing game with `higher` / `lower` hints."""

    name: ClassVar[str] = "guess_number"
    deterministic: ClassVar[bool] = True
    tools: ClassVar[list[dict[str, Any]]] = [
        {
            "type": "function",
            "function": {
                "name": "guess",
                "description": "Guess the secret number; the answer is higher, lower or correct.",
                "parameters": {
                    "type": "object",
                    "properties": {"guess": {"type": "integer", "description": "the guessed number"}},
                    "required": ["guess"],
                },
            },
        }
    ]

    def __init__(self, low: int = 1, high: int = 100, max_guesses: int = 8) -> None:
        if low > high:
            raise ValueError(f"low ({low}) is above high ({high})")
        if max_guesses < 1:
            raise ValueError("max_guesses must be at least 1")
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self._secret: int | None = None
        self._guesses = 0
        self._over = False

    def reset(self, item: EnvItem) -> str:
        secret = item.metadata.get("secret")
        if secret is None:
            self._secret = random.Random(item.seed).randint(self.low, self.high)
        elif isinstance(secret, bool) or not isinstance(secret, int | str) or not _INTEGER.fullmatch(str(secret)):
            raise ValueError(f"metadata secret {secret!r} is not an integer")
        else:
            self._secret = int(secret)
        if not self.low <= self._secret <= self.high:
            raise ValueError(f"the secret {self._secret} is not in {self.low}..{self.high}")
        self._guesses, self._over = 0, False
        return f"guess a number in {self.low}..{self.high}"

    def step(self, action: str) -> StepResult:
        if self._secret is None:
            raise RuntimeError("step before reset")
        if self._over:
            return StepResult("error: the game is over", done=True, info={"valid": False})
        try:
            text = call_argument(action, "guess").strip()
        except ValueError as err:  # a JSON call without its argument: said, as a tool would
            return StepResult(f"error: {err}", info={"valid": False})
        if not _INTEGER.fullmatch(text):
            return StepResult(f"error: {text[:40]!r} is not an integer", info={"valid": False})
        guess = int(text)
        self._guesses += 1
        info: dict[str, str | int | float | bool | None] = {"valid": True, "guesses": self._guesses}
        if guess == self._secret:
            self._over = True
            return StepResult("correct", reward=1.0, done=True, info=info)
        hint = "higher" if self._secret > guess else "lower"
        if self._guesses >= self.max_guesses:
            self._over = True
            return StepResult(f"{hint}; no guesses left, it was {self._secret}", reward=0.0, done=True, info=info)
        return StepResult(hint, info=info)

"""The `calculator` environment: one arithmetic expression per call, its value as the observation.

The expression is read by a tokenizer and a recursive-descent parser of its own, never by `eval`: only
numbers (integers and decimals), `+ - * / // % **`, parentheses and unary signs exist, so no name, call,
attribute or any other Python can run. Values are exact fractions (`0.1 + 0.2` is `0.3`); a result that is an
integer is written without `.0`. Bounds keep every call cheap: the expression's length, the magnitude of every
literal and of every intermediate value (`max_value`), the nesting depth and the exponent of `**`.

    expression := term (("+" | "-") term)*
    term       := unary (("*" | "/" | "//" | "%") unary)*
    unary      := ("+" | "-") unary | power
    power      := atom ("**" unary)?           right-associative, binds tighter than a unary sign (-2**2 = -4)
    atom       := NUMBER | "(" expression ")"

A malformed or failing expression is an observation `error: ...` with `info={"valid": False}`; the episode
never ends here (the policy answers after the observation).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from fractions import Fraction
from typing import Any, ClassVar

from workers.envs.base import EnvItem, StepResult, call_argument

MAX_DEPTH = 32
"""Deepest nesting of parentheses and unary signs."""
MAX_EXPONENT = 64
"""Largest exponent of `**`, in magnitude."""
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(\*\*|//|[-+*/%()]))")


class CalcError(ValueError):
    """Raised by the parser when an expression is malformed or its value is out of bounds or undefined."""


class Calculator:
    """Evaluates arithmetic expressions (`37*45`, `(2 + 3) * -4 / 8`) safely and exactly."""

    name: ClassVar[str] = "calculator"
    deterministic: ClassVar[bool] = True
    tools: ClassVar[list[dict[str, Any]]] = [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "for example (37 + 5) * 45"}},
                    "required": ["expression"],
                },
            },
        }
    ]

    def __init__(self, max_length: int = 200, max_value: int = 10**18, latency_s: float = 0.0) -> None:
        if max_length < 1 or max_value < 1:
            raise ValueError("max_length and max_value must be positive")
        if not 0 <= latency_s <= 60:
            raise ValueError(f"latency_s must be within 0..60 seconds, got {latency_s}")
        self.max_length = max_length
        """Longest expression, in characters."""
        self.max_value = max_value
        """Largest magnitude of a literal, of every intermediate value and of the result."""
        self.latency_s = latency_s
        """Seconds every step takes on top of the arithmetic: a remote tool's latency, for benchmarks and tests."""

    def reset(self, item: EnvItem) -> str:
        return ""

    def step(self, action: str) -> StepResult:
        if self.latency_s:
            time.sleep(self.latency_s)  # the server runs steps in threads: other episodes go on meanwhile
        try:
            expression = call_argument(action, "expression")
            value = evaluate(expression, self.max_length, self.max_value)
        except ValueError as err:  # a CalcError, or a JSON call without the argument
            return StepResult(f"error: {err}", info={"valid": False})
        return StepResult(render(value), info={"valid": True})


def evaluate(expression: str, max_length: int = 200, max_value: int = 10**18) -> Fraction:
    """The exact value of `expression`; CalcError saying what is wrong with it."""
    if len(expression) > max_length:
        raise CalcError(f"the expression is longer than {max_length} characters")
    parser = _Parser(_tokens(expression), max_value)
    value = parser.expression(0)
    if parser.peek() is not None:
        raise CalcError(f"unexpected {parser.peek()!r}")
    return value


def render(value: Fraction) -> str:
    """An integer as its digits, any other value as the shortest decimal that reads back as its float."""
    if value.denominator == 1:
        return str(value.numerator)
    return repr(float(value))


def _tokens(expression: str) -> list[str]:
    tokens: list[str] = []
    position, end = 0, len(expression.rstrip())
    while position < end:
        found = _TOKEN.match(expression, position)
        if found is None:
            at = len(expression) - len(expression[position:].lstrip())
            raise CalcError(f"unexpected character {expression[at]!r} at {at}")
        tokens.append(found.group(1) or found.group(2))
        position = found.end()
    if not tokens:
        raise CalcError("empty expression")
    return tokens


_BINARY: dict[str, Callable[[Fraction, Fraction], Fraction]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "//": lambda a, b: Fraction(a // b),
    "%": lambda a, b: a % b,
}


class _Parser:
    """Recursive descent over the tokens, evaluating as it goes; `depth` bounds the recursion."""

    def __init__(self, tokens: list[str], max_value: int) -> None:
        self._tokens = tokens
        self._next = 0
        self._max = max_value

    def peek(self) -> str | None:
        return self._tokens[self._next] if self._next < len(self._tokens) else None

    def _take(self) -> str:
        token = self.peek()
        if token is None:
            raise CalcError("the expression ends too early")
        self._next += 1
        return token

    def expression(self, depth: int) -> Fraction:
        value = self._term(depth)
        while self.peek() in ("+", "-"):
            value = self._apply(self._take(), value, self._term(depth))
        return value

    def _term(self, depth: int) -> Fraction:
        value = self._unary(depth)
        while self.peek() in ("*", "/", "//", "%"):
            value = self._apply(self._take(), value, self._unary(depth))
        return value

    def _unary(self, depth: int) -> Fraction:
        if self.peek() in ("+", "-"):
            if depth >= MAX_DEPTH:
                raise CalcError(f"nested more than {MAX_DEPTH} deep")
            sign = self._take()
            value = self._unary(depth + 1)
            return -value if sign == "-" else value
        return self._power(depth)

    def _power(self, depth: int) -> Fraction:
        base = self._atom(depth)
        if self.peek() != "**":
            return base
        self._take()
        return self._check(_power(base, self._unary(depth)))

    def _atom(self, depth: int) -> Fraction:
        token = self._take()
        if token == "(":
            if depth >= MAX_DEPTH:
                raise CalcError(f"nested more than {MAX_DEPTH} deep")
            value = self.expression(depth + 1)
            if self.peek() != ")":
                raise CalcError("unbalanced parentheses")
            self._take()
            return value
        if token[0].isdigit() or token[0] == ".":
            return self._check(Fraction(token))
        raise CalcError(f"unexpected {token!r}")

    def _apply(self, operator: str, left: Fraction, right: Fraction) -> Fraction:
        if operator in ("/", "//", "%") and right == 0:
            raise CalcError("division by zero")
        return self._check(_BINARY[operator](left, right))

    def _check(self, value: Fraction) -> Fraction:
        if abs(value) > self._max:
            raise CalcError(f"a value larger than {self._max}")
        return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    """`base ** exponent` for an integer exponent of at most `MAX_EXPONENT` in magnitude: with every operand
    bounded, the exact power has at most a few thousand digits, and the caller bounds it."""
    if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"an exponent must be an integer of at most {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalcError("division by zero")
    return base ** int(exponent)

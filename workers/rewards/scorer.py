"""Rewards as a registry, and the `Scorer` that applies a weighted list of them to one completion.

A reward function is `fn(completion, answer, finish_reason, **options) -> float | dict[str, float]`;
a dict is a set of named components whose sum is the reward. A `python` one may also declare `prompt` and the
item's columns as keyword arguments, or be `batched`: `fn(completions, prompts, answers, **columns, **options)
-> list[float]`, called once per group (`score_many`). The scorer contains every fault: an exception becomes
reward 0 with `error="<ExceptionType>: <message>"`, and a sample with an error is left out of training. User code
(`python` type) runs
in a persistent sandboxed child process (`workers.rewards.sandbox.client`: scrubbed environment, rlimits,
a lesser uid, its own process group and namespaces), one per distinct `sandbox` section, so a hung
function is abandoned after its `timeout_s` (the whole sandbox is killed and restarted on the next
call). The `math` built-in runs there too (math-verify's timeouts need a main thread, and sympy can
hang); the other built-ins are pure and fast, so they run in-process and are not timed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

from pydantic import TypeAdapter, ValidationError

from relax_bus.log import get_logger
from workers.config import AnyReward, MathReward, PythonReward, RewardConfig
from workers.config.rewards import RewardSandbox
from workers.rewards.sandbox.client import RewardFailed, Sandbox
from workers.rewards.values import RewardFn, RewardValue, checked, describe

log = get_logger(__name__)


def exact(completion: str, answer: str | None, finish_reason: str) -> float:
    """1.0 when the stripped completion equals the stripped answer and the model stopped by itself."""
    if answer is None:
        raise ValueError("exact reward needs a reference answer")
    return float(finish_reason == "stop" and completion.strip() == answer.strip())


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def numeric(completion: str, answer: str | None, finish_reason: str, tolerance: float = 1e-6) -> float:
    """1.0 when the first number in the completion is within `tolerance` of float(answer); 0 if there is none."""
    if answer is None:
        raise ValueError("numeric reward needs a reference answer")
    target = float(answer)
    found = _NUMBER.search(completion)
    if found is None:
        return 0.0
    return float(abs(float(found.group()) - target) <= tolerance)


@lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def format_match(completion: str, answer: str | None, finish_reason: str, pattern: str) -> float:
    """1.0 when the whole completion matches the regex `pattern`."""
    return float(_compiled(pattern).fullmatch(completion) is not None)


BUILTINS: dict[str, RewardFn] = {
    "exact": exact,
    "numeric": numeric,
    "format": format_match,
}
"""In-process reward functions by type; `CHILD_BUILTINS` and `python` (user code) run in the sandbox."""
CHILD_BUILTINS: dict[str, str] = {
    "math": "workers.rewards.verifiers:math_answer",
}
"""Built-in reward functions run in the sandbox, by type: `module:callable`."""
_REWARD = TypeAdapter(RewardConfig)
_DEFAULTS: dict[str, tuple[str, ...]] = {
    "addition": ("exact",),
    "reverse": ("exact",),
    "jsonl": ("exact",),
    "hf": ("exact",),
    "omni": ("exact",),
    "arithmetic": ("exact",),
}


def default_rewards(task: str) -> list[AnyReward]:
    """The rewards a task is scored with when the config names none."""
    if task not in _DEFAULTS:
        raise ValueError(
            f"task {task!r} has no default reward; configure rewards (tasks with one: {sorted(_DEFAULTS)})"
        )
    return [_REWARD.validate_python({"type": t}) for t in _DEFAULTS[task]]


class Score(NamedTuple):
    """A completion's reward, its weighted components (which sum to it) and the error that zeroed it."""

    reward: float
    components: dict[str, float]
    error: str | None


class Scorer:
    """Scores completions with a weighted sum of reward functions; never raises from `score`."""

    def __init__(self, specs: Sequence[AnyReward | Mapping[str, Any]]) -> None:
        self.specs = [_reward(s) for s in specs]
        if not self.specs:
            raise ValueError("a scorer needs at least one reward")
        labels = [s.label for s in self.specs]
        if duplicated := sorted({n for n in labels if labels.count(n) > 1}):
            raise ValueError(f"several rewards named {duplicated}; give each a distinct `name`")
        for spec in self.specs:
            if spec.type in BUILTINS:
                _dry_run(spec)
        functions: dict[RewardSandbox, list[tuple[str, dict[str, Any]]]] = {}
        for spec in self.specs:
            if (ref := _child_function(spec)) is not None:
                assert isinstance(spec, PythonReward | MathReward)
                functions.setdefault(spec.sandbox, []).append((ref, spec.call_options()))
        batched = {s.options.function for s in self.specs if isinstance(s, PythonReward) and s.batched}
        self._sandboxes = {settings: Sandbox(fns, settings, batched=batched) for settings, fns in functions.items()}
        """One sandbox per distinct `sandbox` section of the rewards that run user code."""
        try:
            for sandbox in self._sandboxes.values():
                sandbox.start()
        except ValueError:
            self.close()
            raise

    def score(
        self,
        completion: str,
        answer: str | None,
        finish_reason: str,
        prompt: str | None = None,
        columns: Mapping[str, Any] | None = None,
    ) -> Score:
        """Weighted sum of every reward; reward 0 and the error text if any of them fails or times out."""
        return self.score_many([completion], answer, [finish_reason], prompt, columns)[0]

    def score_many(
        self,
        completions: Sequence[str],
        answer: str | None,
        finish_reasons: Sequence[str],
        prompt: str | None = None,
        columns: Mapping[str, Any] | None = None,
    ) -> list[Score]:
        """`score` of each completion of one group (one prompt, answer and set of columns): a batched reward is
        called once for them all, and its failure is every sample's error."""
        count = len(completions)
        columns = dict(columns or {})
        values: list[list[RewardValue | str]] = []  # [rewards][samples]: a value, or the error text
        for spec in self.specs:
            if isinstance(spec, PythonReward) and spec.batched:
                batch = _contained(spec, self._call_batch, spec, completions, answer, finish_reasons, prompt, columns)
                values.append(list(batch) if isinstance(batch, list) else [batch] * count)
                continue
            values.append(
                [
                    _contained(spec, self._call, spec, c, answer, f, prompt, columns)
                    for c, f in zip(completions, finish_reasons, strict=True)
                ]
            )
        return [self._combine([v[i] for v in values]) for i in range(count)]

    def _combine(self, values: list[RewardValue | str]) -> Score:
        """One sample's Score from each reward's value (or error text), in the specs' order."""
        components: dict[str, float] = {}
        for spec, value in zip(self.specs, values, strict=True):
            if isinstance(value, str):
                return Score(0.0, {}, value)
            if isinstance(value, dict):
                components.update({f"{spec.label}.{k}": spec.weight * v for k, v in value.items()})
            else:
                components[spec.label] = spec.weight * value
        return Score(sum(components.values()), components, None)

    def close(self) -> None:
        """Stop the sandboxes, and every process in them."""
        for sandbox in self._sandboxes.values():
            sandbox.stop()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call_batch(
        self,
        spec: PythonReward,
        completions: Sequence[str],
        answer: str | None,
        finish_reasons: Sequence[str],
        prompt: str | None,
        columns: Mapping[str, Any],
    ) -> list[float]:
        count = len(completions)
        return self._sandboxes[spec.sandbox].call_batch(
            spec.options.function,
            completions,
            [prompt or ""] * count,
            [answer] * count,
            finish_reasons,
            {k: [v] * count for k, v in columns.items()},
            spec.call_options(),
            spec.timeout_s,
        )

    def _call(
        self,
        spec: AnyReward,
        completion: str,
        answer: str | None,
        finish_reason: str,
        prompt: str | None,
        columns: Mapping[str, Any],
    ) -> RewardValue:
        ref = _child_function(spec)
        if ref is not None:
            assert isinstance(spec, PythonReward | MathReward)
            sandbox = self._sandboxes[spec.sandbox]
            options = spec.call_options()
            if isinstance(spec, MathReward):  # a built-in: its signature is fixed
                return sandbox.call(ref, completion, answer, finish_reason, options, spec.timeout_s)
            return sandbox.call(ref, completion, answer, finish_reason, options, spec.timeout_s, prompt, columns)
        return checked(BUILTINS[spec.type](completion, answer, finish_reason, **spec.call_options()))


def _contained(spec: AnyReward, call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args)`'s value, or the error text of its failure (never raised)."""
    try:
        return call(*args)
    except Exception as err:  # deliberate: a failing reward fails its samples, never the worker
        error = str(err) if isinstance(err, RewardFailed) else describe(err)
        log.debug("reward_failed", reward=spec.label, error=error)
        return error


def _child_function(spec: AnyReward) -> str | None:
    """`module:callable` of a reward that runs in the sandbox; None for an in-process built-in."""
    if isinstance(spec, PythonReward):
        return spec.options.function
    return CHILD_BUILTINS.get(spec.type)


def _reward(spec: AnyReward | Mapping[str, Any]) -> AnyReward:
    """A reward config, validated from a mapping if need be (ValueError listing the problems)."""
    if not isinstance(spec, Mapping):
        return spec
    try:
        return _REWARD.validate_python(spec)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ValueError(f"bad reward {dict(spec)}: {problems}") from None


def _dry_run(spec: AnyReward) -> None:
    """Call a built-in once on an empty completion so bad options fail at construction, not per sample."""
    try:
        BUILTINS[spec.type]("", "0", "stop", **spec.call_options())
    except Exception as err:
        raise ValueError(
            f"reward {spec.label!r} ({spec.type}) has bad options {spec.call_options()}: {describe(err)}"
        ) from None

"""Rewards as a registry, and the `Scorer` that applies a weighted list of them to one completion.

A reward function is `fn(completion, answer, finish_reason, **options) -> float | dict[str, float]`;
a dict is a set of named components whose sum is the reward. The scorer contains every fault: an
exception becomes reward 0 with `error="<ExceptionType>: <message>"`. User code (`python` type) runs
in one persistent spawned child process per scorer, so a hung function is abandoned after its
`timeout_s` (the child is killed by PID and restarted on the next call). Built-ins are pure and
fast, so they run in-process and are not timed.
"""

from __future__ import annotations

import importlib
import inspect
import math
import multiprocessing
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relax_bus.log import get_logger

log = get_logger(__name__)

RewardValue = float | dict[str, float]
RewardFn = Callable[..., RewardValue]
START_TIMEOUT_S = 60.0
"""How long the user-code child may take to start and import every user function."""


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
"""In-process reward functions by type; `python` (user code in a child process) is the other type."""
REWARD_TYPES = (*BUILTINS, "python")
_DEFAULTS: dict[str, tuple[str, ...]] = {
    "addition": ("exact",),
    "reverse": ("exact",),
    "jsonl": ("exact",),
}


class RewardSpec(BaseModel):
    """One reward function of a scorer, with its weight and options."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: str
    """Registry key: exact, numeric, format, or python (user code, option `function`)."""
    weight: float = 1.0
    """Multiplier applied to the function's value (to each component of a dict)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the function; for python, `function="module:callable"` plus its own options."""
    name: str | None = Field(default=None, min_length=1)
    """Component name; defaults to the type (the callable's name for python)."""
    timeout_s: float = Field(default=5.0, gt=0)
    """How long a python function may run on one sample before it is abandoned."""

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in REWARD_TYPES:
            raise ValueError(f"unknown reward type {value!r}; known types: {', '.join(REWARD_TYPES)}")
        return value

    @model_validator(mode="after")
    def _python_function(self) -> RewardSpec:
        if self.type == "python":
            ref = self.options.get("function")
            if not isinstance(ref, str) or not re.fullmatch(r"[\w.]+:[\w.]+", ref):
                raise ValueError(f"python reward needs option function='module:callable', got {ref!r}")
        return self

    @property
    def label(self) -> str:
        """The name its components are recorded under."""
        if self.name:
            return self.name
        if self.type == "python":
            return str(self.options["function"]).rpartition(":")[2].rpartition(".")[2]
        return self.type


def default_rewards(task: str) -> list[RewardSpec]:
    """The rewards a task is scored with when the config names none."""
    if task not in _DEFAULTS:
        raise ValueError(
            f"task {task!r} has no default reward; configure rewards (tasks with one: {sorted(_DEFAULTS)})"
        )
    return [RewardSpec(type=t) for t in _DEFAULTS[task]]


class Score(NamedTuple):
    """A completion's reward, its weighted components (which sum to it) and the error that zeroed it."""

    reward: float
    components: dict[str, float]
    error: str | None


class Scorer:
    """Scores completions with a weighted sum of reward functions; never raises from `score`."""

    def __init__(self, specs: Sequence[RewardSpec | Mapping[str, Any]]) -> None:
        self.specs = [s if isinstance(s, RewardSpec) else RewardSpec.model_validate(s) for s in specs]
        if not self.specs:
            raise ValueError("a scorer needs at least one reward")
        labels = [s.label for s in self.specs]
        if duplicated := sorted({n for n in labels if labels.count(n) > 1}):
            raise ValueError(f"several rewards named {duplicated}; give each a distinct `name`")
        for spec in self.specs:
            if spec.type in BUILTINS:
                _dry_run(spec)
        user = [(s.options["function"], _user_options(s)) for s in self.specs if s.type == "python"]
        self._child = _UserProcess(user) if user else None
        if self._child is not None:
            self._child.start()

    def score(self, completion: str, answer: str | None, finish_reason: str) -> Score:
        """Weighted sum of every reward; reward 0 and the error text if any of them fails or times out."""
        components: dict[str, float] = {}
        for spec in self.specs:
            try:
                value = self._call(spec, completion, answer, finish_reason)
            except Exception as err:  # deliberate: a failing reward zeroes one sample, never the worker
                error = str(err) if isinstance(err, _RewardFailed) else _describe(err)
                log.debug("reward_failed", reward=spec.label, error=error)
                return Score(0.0, {}, error)
            if isinstance(value, dict):
                components.update({f"{spec.label}.{k}": spec.weight * v for k, v in value.items()})
            else:
                components[spec.label] = spec.weight * value
        return Score(sum(components.values()), components, None)

    def close(self) -> None:
        """Stop the user-code child process, if any."""
        if self._child is not None:
            self._child.stop()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, spec: RewardSpec, completion: str, answer: str | None, finish_reason: str) -> RewardValue:
        if spec.type == "python":
            assert self._child is not None
            return self._child.call(
                spec.options["function"], completion, answer, finish_reason, _user_options(spec), spec.timeout_s
            )
        return _checked(BUILTINS[spec.type](completion, answer, finish_reason, **spec.options))


class _RewardFailed(Exception):
    """Raised inside the scorer when one reward function failed; its message is the recorded error."""


def _user_options(spec: RewardSpec) -> dict[str, Any]:
    return {k: v for k, v in spec.options.items() if k != "function"}


def _dry_run(spec: RewardSpec) -> None:
    """Call a built-in once on an empty completion so bad options fail at construction, not per sample."""
    try:
        BUILTINS[spec.type]("", "0", "stop", **spec.options)
    except Exception as err:
        raise ValueError(
            f"reward {spec.label!r} ({spec.type}) has bad options {spec.options}: {_describe(err)}"
        ) from None


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _checked(value: Any) -> RewardValue:
    """The value as a finite float or a dict of finite floats; TypeError/ValueError otherwise."""
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    return _finite(value)


def _finite(value: Any) -> float:
    if not isinstance(value, int | float):
        raise TypeError(f"reward function returned {type(value).__name__}, expected a float or a dict of floats")
    if not math.isfinite(value):
        raise ValueError(f"reward function returned {value}")
    return float(value)


def import_function(ref: str) -> RewardFn:
    """The callable named by `module:qualified.name`."""
    module_name, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in qualname.split("."):
        obj = getattr(obj, attr)
    if not callable(obj):
        raise TypeError(f"{ref} is a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[no-any-return]


def _serve(conn: Connection) -> None:
    """Child loop: `("load", ref, options)` imports and checks a function, `("call", ref, *args)` runs it."""
    functions: dict[str, RewardFn] = {}
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent went away
            return
        try:
            if request[0] == "load":
                _, ref, options = request
                functions[ref] = fn = import_function(ref)
                try:
                    signature = inspect.signature(fn)
                except ValueError:  # some builtins have no signature to check
                    signature = None
                reply: tuple[str, Any] = ("ok", None)
                if signature is not None:
                    try:
                        signature.bind("", None, "stop", **options)
                    except TypeError as err:
                        reply = ("bad_options", str(err))
            else:
                _, ref, completion, answer, finish_reason, options = request
                reply = ("ok", _checked(functions[ref](completion, answer, finish_reason, **options)))
        except Exception as err:  # deliberate: user code faults are reported to the parent, not fatal
            reply = ("error", _describe(err))
        conn.send(reply)


class _UserProcess:
    """A persistent spawned child that imports and runs user reward functions; killed by PID on timeout."""

    def __init__(self, functions: Sequence[tuple[str, dict[str, Any]]]) -> None:
        self._functions = list(functions)
        """`(module:callable, options)` of every python reward, loaded and checked on each start."""
        self._context = multiprocessing.get_context("spawn")
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Spawn the child and import every function; ValueError names the first that cannot be imported."""
        with self._lock:
            try:
                self._start()
            except _RewardFailed as err:
                raise ValueError(str(err)) from None

    def call(
        self,
        ref: str,
        completion: str,
        answer: str | None,
        finish_reason: str,
        options: dict[str, Any],
        timeout_s: float,
    ) -> RewardValue:
        """Run one function in the child; _RewardFailed on its error, on a timeout or if the child died."""
        with self._lock:
            if self._conn is None:
                self._start()
            reply = self._request(("call", ref, completion, answer, finish_reason, options), timeout_s)
        if reply[0] == "error":
            raise _RewardFailed(reply[1])
        return reply[1]  # type: ignore[no-any-return]

    def stop(self) -> None:
        """Kill the child by PID and forget it; the next call starts a fresh one."""
        with self._lock:
            self._kill()

    def _start(self) -> None:
        parent, child = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(child,), name="reward-user-code", daemon=True)
        process.start()
        child.close()
        self._process, self._conn = process, parent
        log.debug("reward_process_started", pid=process.pid, functions=sorted({ref for ref, _ in self._functions}))
        for ref, options in self._functions:
            try:
                reply = self._request(("load", ref, options), START_TIMEOUT_S)
            except _RewardFailed as err:
                reply = ("error", str(err))
            if reply[0] != "ok":
                self._kill()
                problem = "cannot be imported" if reply[0] == "error" else f"does not take the options {options}"
                raise _RewardFailed(f"reward function {ref!r} {problem}: {reply[1]}")

    def _request(self, request: tuple[Any, ...], timeout_s: float) -> tuple[str, Any]:
        assert self._conn is not None and self._process is not None
        try:
            self._conn.send(request)
            if self._conn.poll(timeout_s):
                return self._conn.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError):
            self._process.join(1.0)
            code = self._process.exitcode
            self._kill()
            raise _RewardFailed(f"RewardProcessDied: the reward process exited (code {code})") from None
        log.warning("reward_timeout", request=request[0], function=request[1], timeout_s=timeout_s)
        self._kill()
        raise _RewardFailed(f"timed out after {timeout_s:g}s")

    def _kill(self) -> None:
        if self._process is not None:
            if self._process.is_alive():
                self._process.kill()  # SIGKILL to the child's PID: a hung function ignores anything softer
            self._process.join(5.0)
            self._process.close()
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None

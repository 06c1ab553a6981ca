"""The environment interface of agentic episodes, and the registry of built-in environments.

An episode alternates policy turns and observations. The rollout role reads each policy turn through the run's
tool-call format (`agent.format`): a turn that calls a tool becomes one `step(action)` of the episode's
environment, whose observation is appended to the episode (never trained); a turn without a call is the episode's
final answer. An environment instance serves one episode: `reset(item)` starts it, `step(action)` advances it.

    reset(item)   -> first observation ("" for none), appended after the prompt
    step(action)  -> StepResult(observation, reward, done, info)

`action` is the call's text as the format extracts it: `37*45` from the tiny model's `<call>37*45</call>`, the JSON
object `{"name": ..., "arguments": {...}}` from a chat model's `<tool_call>...</tool_call>`. `reward` is the step's
own reward (None: the step gives none); `done` ends the episode after this observation. An environment that
cannot take an action (a malformed call) says so in its observation, as a tool would, and the episode goes on;
an exception is an environment error, which ends the episode with a typed reason.

`deterministic = True` says that replaying an episode's actions on a fresh instance after `reset(item)` gives the
same observations: an episode whose server died is then replayed on another instance and continues; otherwise it
ends with the reason `env_lost`. Environments run in the environment role's processes, never in the rollout's.
Adding an environment is one class (with `name` and the `Environment` methods) plus one line in `ENVIRONMENTS`,
or, for a user's own, `agent.env: {type: my_module:MyEnv, options: {...}}` in the run config.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

Scalar = str | int | float | bool | None

ENVIRONMENTS: dict[str, str] = {
    "calculator": "workers.envs.calculator:Calculator",
    "guess_number": "workers.envs.guess_number:GuessNumber",
    "python": "workers.envs.python_tool:PythonTool",
}


@dataclass(frozen=True)
class EnvItem:
    """What an environment is told about its episode at `reset`."""

    episode: str
    """Episode id (`<group>/<attempt>/<sample>`), unique in the run."""
    prompt: str
    """The prompt's text."""
    answer: str | None = None
    """The task's reference answer, when it has one."""
    metadata: dict[str, Scalar] = field(default_factory=dict)
    """The prompt group's metadata."""
    seed: int = 0
    """A seed for the episode's randomness, the same on every replay of it."""


@dataclass(frozen=True)
class StepResult:
    """What one action did."""

    observation: str
    """Text appended to the episode after the call (rendered by the tool-call format)."""
    reward: float | None = None
    """This step's reward; None: none."""
    done: bool = False
    """The episode ends after this observation."""
    info: dict[str, Scalar] = field(default_factory=dict)
    """Named scalars for logs and metrics (e.g. `valid: True`)."""


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (constructed with the config's `options` as keyword arguments)."""

    name: ClassVar[str]
    deterministic: ClassVar[bool]

    def reset(self, item: EnvItem) -> str:
        """Start the episode; the first observation ("" for none)."""
        ...

    def step(self, action: str) -> StepResult:
        """Take one action of the policy."""
        ...


def tools_of(env_class: type) -> list[dict[str, Any]]:
    """The JSON-schema tool descriptions an environment class offers to a chat template (`tools = [...]` on the
    class), empty when it declares none."""
    return list(getattr(env_class, "tools", []) or [])


def env_class(spec: str) -> type:
    """The environment class a config names: a built-in (`calculator`) or `module:Class`; ValueError otherwise."""
    target = ENVIRONMENTS.get(spec, spec)
    if ":" not in target:
        raise ValueError(
            f"unknown environment {spec!r}: a built-in ({', '.join(sorted(ENVIRONMENTS))}) or module:Class"
        )
    module_name, class_name = target.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"environment {spec!r}: cannot import {module_name}: {err}") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"environment {spec!r}: {module_name} has no class {class_name}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment {spec!r}: {class_name} lacks {', '.join(missing)}")
    return cls


def make_env(spec: str, options: dict[str, Any] | None = None) -> Environment:
    """A fresh instance of the environment `spec` names, with `options` as keyword arguments."""
    cls = env_class(spec)
    try:
        env: Environment = cls(**(options or {}))
    except TypeError as err:
        raise ValueError(f"environment {spec!r}: bad options {sorted(options or {})}: {err}") from None
    return env

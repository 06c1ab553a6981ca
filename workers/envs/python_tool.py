"""The `python` environment: each call is a Python program; what it printed (or its error) is the observation.

Programs run in the reward sandbox (`workers.rewards.sandbox`, docs/sandbox.md), the same confined child that
runs code-executing rewards: a scrubbed environment without credentials, no network, a private read-only view
of the filesystem, a lesser uid, rlimits and one memory limit for its whole process tree. Each instance starts
its sandbox when it is built and refuses to be built (one line, `SandboxNotIsolated`) where this machine
refuses the isolation, unless `sandbox: unisolated` is in its options, exactly as a `python` reward does.
Inside, `workers.envs.python_program.run_program` runs each program in a process of its own, so a program
changes nothing for the next one and its deadline (`timeout_s`) costs only that process.

    observation   what the program printed on stdout (cut to `max_output_chars`), then the last line of its
                  error (`ZeroDivisionError: division by zero`) if it raised, `error: ...` if it could not run
    info          valid (False when it does not compile, or the call has no `code`), timed_out, cut

Programs are pure functions of their text unless they read the clock or a random source, so the environment
is deterministic: a replayed episode meets the same observations. `close()` stops the sandbox (it is also
stopped when the instance is collected).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import ValidationError

from workers.config.rewards import RewardSandbox
from workers.envs.base import EnvItem, StepResult, call_argument
from workers.rewards.sandbox.client import RewardFailed, Sandbox

PROGRAM = "workers.envs.python_program:run_program"
"""The function the sandbox runs for each call."""
DEADLINE_GRACE_S = 5.0
"""How much longer than `timeout_s` the sandbox as a whole may take before it is killed and replaced."""


class PythonTool:
    """Runs Python programs in the sandbox and observes their output."""

    name: ClassVar[str] = "python"
    deterministic: ClassVar[bool] = True
    tools: ClassVar[list[dict[str, Any]]] = [
        {
            "type": "function",
            "function": {
                "name": "python",
                "description": "Run a Python program; the result is what it prints, or its error.",
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "the program; print what you need"}},
                    "required": ["code"],
                },
            },
        }
    ]

    def __init__(
        self,
        timeout_s: float = 5.0,
        max_output_chars: int = 2000,
        memory_mb: int | None = 512,
        sandbox: str | dict[str, Any] = "required",
    ) -> None:
        if not 0 < timeout_s <= 600:
            raise ValueError(f"timeout_s must be in (0, 600], not {timeout_s}")
        if max_output_chars < 1:
            raise ValueError("max_output_chars must be at least 1")
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.settings = sandbox_settings(sandbox, memory_mb)
        """The sandbox's limits and isolation (`RewardSandbox`, as a reward's `sandbox` section)."""
        self._options = {"timeout_s": timeout_s, "max_output_chars": max_output_chars}
        self._sandbox = Sandbox([(PROGRAM, self._options)], self.settings, owner="environment")
        self._sandbox.start()  # SandboxNotIsolated (a ValueError, one line) when isolation is missing

    def reset(self, item: EnvItem) -> str:
        return ""

    def step(self, action: str) -> StepResult:
        try:
            code = call_argument(action, "code")
        except ValueError as err:  # a JSON call without its argument: said, as a tool would
            return StepResult(f"error: {err}", info={"valid": False})
        try:
            result = self._sandbox.call_json(PROGRAM, code, self._options, self.timeout_s + DEADLINE_GRACE_S)
        except RewardFailed as err:  # the sandbox broke (out of memory, killed): the next call starts another
            return StepResult(f"error: {err}", info={"valid": True, "timed_out": False, "cut": False})
        return _observed(result)

    def close(self) -> None:
        """Stop the sandbox and every process in it."""
        self._sandbox.stop()


def sandbox_settings(sandbox: str | dict[str, Any], memory_mb: int | None) -> RewardSandbox:
    """The `sandbox` option (`required`, `unisolated` or a reward's `sandbox` section) with `memory_mb` as its
    memory limit; ValueError in one line."""
    if sandbox in ("required", "unisolated"):
        fields: dict[str, Any] = {"isolation": sandbox}
    elif isinstance(sandbox, dict):
        if "memory_mb" in sandbox:
            raise ValueError("give the memory limit once, as the option memory_mb, not in sandbox")
        fields = dict(sandbox)
    else:
        raise ValueError(f"sandbox must be required, unisolated or a mapping, not {sandbox!r}")
    try:
        return RewardSandbox.model_validate({**fields, "memory_mb": memory_mb})
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ValueError(f"bad sandbox options: {problems}") from None


def _observed(result: Any) -> StepResult:
    """The step of a program's result, checked: it comes from the sandbox, which is trusted with nothing."""
    fields = {"output": str, "error": (str, type(None)), "valid": bool, "timed_out": bool, "cut": bool}
    if not isinstance(result, dict) or any(not isinstance(result.get(k), t) for k, t in fields.items()):
        return StepResult("error: the sandbox sent a malformed result", info={"valid": True})
    observation, error = result["output"], result["error"]
    if error is not None:
        observation += f"\n{error}" if observation and not observation.endswith("\n") else error
    info: dict[str, str | int | float | bool | None] = {
        "valid": result["valid"],
        "timed_out": result["timed_out"],
        "cut": result["cut"],
    }
    return StepResult(observation, info=info)

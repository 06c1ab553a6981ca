"""The metrics role's sinks: each holds every step once across a restart, read back with the sink's own
reader (TensorBoard's event loader, W&B's record format); Prometheus scraped over 127.0.0.1."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.request
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
from tensorboard.util.tensor_util import make_ndarray
from wandb.proto.wandb_internal_pb2 import Record

from relax_bus.errors import ConfigError
from schemas import Metric, RunEvent, StepSample
from workers.config import MetricsLaunch, WandbConfig, WandbEnv, parse_config
from workers.launch.launcher import metrics_launch, metrics_sinks_line
from workers.metrics.prometheus import PrometheusSink
from workers.metrics.samples import TABLE_COLUMNS
from workers.metrics.sinks import EvalPoint, JsonlSink, SamplesSink, TensorBoardSink, WandbSink, open_sinks
from workers.roles.metrics import metrics_dir, prometheus_port

pytestmark = pytest.mark.unit
RUN = "sinks"


def point(step: int) -> Metric:
    return Metric(run=RUN, step=step, values={"reward_mean": step / 10, "version": float(step)})


def logged(step: int, index: int) -> StepSample:
    return StepSample(
        group_id=f"g{step}",
        index=index,
        policy_version=step - 1,
        prompt=f"{step}+{index}=",
        response="naïve → 3\n    indented",
        reward=1.5,
        terms={"correct": 1.0, "format": 0.5},
    )


def with_samples(step: int, count: int = 2) -> Metric:
    """A step with `count` logged samples, and values a step may leave uncomputed (NaN) under namespaced names."""
    values = {"reward_mean": step / 10, "reward/correct/mean": 1.0, "policy/neg_logprob_mean": math.nan}
    return Metric(run=RUN, step=step, values=values, samples=tuple(logged(step, i) for i in range(count)))


def wandb_sink(out_dir: Path, run: str, **env: str) -> WandbSink:
    """An offline W&B sink with the default `metrics.wandb`, under no `WANDB_*` variable but `env`."""
    return WandbSink(out_dir, run, WandbConfig(), WandbEnv.model_construct(**env), {"run": run})


def feed(sink, steps) -> int:
    written = sink.write(point(s) for s in steps)
    sink.flush()
    return written


def test_jsonl_writes_each_step_once_across_a_restart(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = JsonlSink(path)
    assert feed(first, range(1, 6)) == 5
    first.close()
    again = JsonlSink(path)  # a restarted role: the redelivered 3..5 are skipped
    assert again.last_step == 5
    assert feed(again, range(3, 9)) == 3
    again.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 9))
    assert lines[0] == {"step": 1, "at": lines[0]["at"], "reward_mean": 0.1, "version": 1.0}


def test_jsonl_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "at": 0}\n{"step": 2, "at"')  # killed mid-line
    sink = JsonlSink(path)
    assert sink.last_step == 1
    feed(sink, [2])
    sink.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_samples_jsonl_writes_each_step_once_across_a_restart(tmp_path):
    path = tmp_path / "samples.jsonl"
    first = SamplesSink(path)
    assert first.write([with_samples(1), point(2), with_samples(3)]) == 3  # a step without samples writes no line
    first.close()
    again = SamplesSink(path)
    assert again.last_step == 3
    again.write(with_samples(s, 1) for s in (2, 3, 4))
    again.close()
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [(line["step"], line["index"]) for line in lines] == [(1, 0), (1, 1), (3, 0), (3, 1), (4, 0)]
    assert list(lines[0]) == ["step", "at", *TABLE_COLUMNS[1:]]
    assert lines[0]["response"] == "naïve → 3\n    indented" and lines[0]["terms"] == {"correct": 1.0, "format": 0.5}
    assert "naïve" in path.read_text(encoding="utf-8")  # readable as it is, not escaped


def test_nan_values_and_namespaced_names_go_through_every_file_sink(tmp_path):
    sinks = [JsonlSink(tmp_path / "metrics.jsonl"), TensorBoardSink(tmp_path / "tensorboard")]
    sinks.append(wandb_sink(tmp_path, "nan-sinks"))
    try:
        for sink in sinks:
            assert sink.write([with_samples(1)]) == 1
            sink.flush()
    finally:
        for sink in sinks:
            sink.close()
    (line,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert math.isnan(line["policy/neg_logprob_mean"]) and line["reward/correct/mean"] == 1.0
    ((_, value),) = tensorboard_series(tmp_path / "tensorboard", "policy/neg_logprob_mean")
    assert math.isnan(value)
    assert tensorboard_series(tmp_path / "tensorboard", "reward/correct/mean") == [(1, 1.0)]
    (history,) = wandb_history_when(tmp_path / "wandb", 1)
    assert history["reward/correct/mean"] == 1.0 and math.isnan(history["policy/neg_logprob_mean"])
    assert history["samples/_type"] == "table-file" and history["samples/nrows"] == 2, history
    (table,) = (tmp_path / "wandb").glob(f"offline-run-*/files/{history['samples/path']}")
    data = json.loads(table.read_text())
    assert data["columns"] == list(TABLE_COLUMNS) and [r[2] for r in data["data"]] == [0, 1]  # index


def test_tensorboard_shows_a_steps_samples_as_text(tmp_path):
    logdir = tmp_path / "tensorboard"
    sink = TensorBoardSink(logdir)
    sink.write([with_samples(1), point(2), with_samples(3, 1)])
    sink.close()
    texts = tensorboard_texts(logdir, "samples")
    assert [step for step, _ in texts] == [1, 3]
    text = texts[0][1]
    assert text.count("**group** g1") == 2 and "**reward** 1.500 (correct 1.000, format 0.500)" in text
    assert "\n    naïve → 3\n        indented" in text  # an indented block: shown as it is
    assert TensorBoardSink(logdir).last_step == 3


def tensorboard_texts(logdir: Path, tag: str) -> list[tuple[int, str]]:
    acc = EventAccumulator(str(logdir), size_guidance={TENSORS: 0})
    acc.Reload()
    return [(e.step, make_ndarray(e.tensor_proto).item().decode()) for e in acc.Tensors(tag)]


def tensorboard_series(logdir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(logdir), size_guidance={TENSORS: 0})
    acc.Reload()
    return [(e.step, float(make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


def test_tensorboard_writes_each_step_once_across_a_restart(tmp_path):
    logdir = tmp_path / "tensorboard"
    first = TensorBoardSink(logdir)
    feed(first, range(1, 6))
    first.close()
    again = TensorBoardSink(logdir)
    assert again.last_step == 5
    feed(again, range(3, 9))
    again.close()
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 2  # one file per process, read as one run
    series = tensorboard_series(logdir, "reward_mean")
    assert [s for s, _ in series] == list(range(1, 9))
    assert series[6][1] == pytest.approx(0.7)


def wandb_records(path: Path) -> list[Record]:
    """The records of a W&B run file: a 7-byte header, then 32 KiB blocks of chunks (crc32c, length, type)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in the block for a chunk header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def wandb_history(wandb_dir: Path) -> list[dict[str, object]]:
    """Every history record of the offline runs under `wandb_dir`, values decoded, in order."""
    out = []
    for path in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        for r in wandb_records(path):
            if r.WhichOneof("record_type") == "history":
                out.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
    return out


def wandb_history_when(wandb_dir: Path, count: int, timeout_s: float = 30.0) -> list[dict[str, object]]:
    """`wandb_history` once `count` records are there (see `wandb_points_when`)."""
    deadline = time.monotonic() + timeout_s
    while len(records := wandb_history(wandb_dir)) < count and time.monotonic() < deadline:
        time.sleep(0.2)  # poll; the caller asserts on what came
    return records


def wandb_points(wandb_dir: Path) -> list[tuple[int, float]]:
    """(step, reward_mean) of each step's record (an evaluation's record has no reward_mean)."""
    steps = [h for h in wandb_history(wandb_dir) if "reward_mean" in h]
    return [(int(h["_step"]), float(h["reward_mean"])) for h in steps]  # type: ignore[arg-type]


def wandb_points_when(wandb_dir: Path, count: int, timeout_s: float = 30.0) -> list[tuple[int, float]]:
    """`wandb_points` once `count` are there: wandb's service process writes the file on its own time, and
    on a loaded machine it may still be writing when `finish()` has returned."""
    deadline = time.monotonic() + timeout_s
    while len(points := wandb_points(wandb_dir)) < count and time.monotonic() < deadline:
        time.sleep(0.2)  # poll; the caller asserts on what came
    return points


def test_wandb_offline_run_holds_each_step_once_across_a_restart(tmp_path):
    first = wandb_sink(tmp_path, RUN)
    feed(first, range(1, 6))
    first.close()
    again = wandb_sink(tmp_path, RUN)
    assert again.last_step == 5
    feed(again, range(3, 9))
    again.close()
    points = wandb_points_when(tmp_path / "wandb", 8)
    assert [s for s, _ in points] == list(range(1, 9)), points
    assert points[-1][1] == pytest.approx(0.8)


def test_a_wandb_sink_never_takes_over_a_run_still_open_in_the_process(tmp_path):
    """wandb.init's default hands back an unfinished run of the same process: each sink must get its own."""
    left_open = wandb_sink(tmp_path / "a", "open")
    mine = wandb_sink(tmp_path / "b", RUN)
    try:
        feed(mine, range(1, 4))
    finally:
        mine.close()
        left_open.close()
    assert [s for s, _ in wandb_points_when(tmp_path / "b" / "wandb", 3)] == [1, 2, 3]
    assert wandb_points(tmp_path / "a" / "wandb") == []


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def sample(text: str, metric: str, run: str = RUN, **labels: str) -> float | None:
    """The value of `metric` with these labels (and `run`) in a Prometheus text exposition; None if absent."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted({"run": run, **labels}.items()))
    found = re.search(rf"^{metric}\{{{re.escape(want)}\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def sample_of(url: str, metric: str, run: str, **labels: str) -> float | None:
    """Scrape `url` once and read one sample of it."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        return sample(reply.read().decode(), metric, run, **labels)


def test_prometheus_endpoint_shows_gauges_that_move():
    sink = PrometheusSink(RUN, "127.0.0.1", 0)
    try:
        sink.observe(point(1))
        first = scrape(sink.port)
        assert sample(first, "relax_step") == 1.0
        assert sample(first, "relax_reward_mean") == pytest.approx(0.1)
        sink.observe(point(2))
        sink.observe(RunEvent(run=RUN, event="group_dropped", fields={"lag": 3}))
        sink.observe(RunEvent(run=RUN, event="group_requeued"))
        sink.set_server_state({"prompts": 7}, {"rollout": 2}, dead_letters=1)
        second = scrape(sink.port)
        assert sample(second, "relax_step") == 2.0
        assert sample(second, "relax_policy_version") == 2.0
        assert sample(second, "relax_step_value", name="reward_mean") == pytest.approx(0.2)
        assert sample(second, "relax_groups_dropped_total") == 1.0
        assert sample(second, "relax_groups_requeued_total") == 1.0
        assert sample(second, "relax_events_total", event="group_dropped") == 1.0
        assert sample(second, "relax_queue_depth", hop="prompts") == 7.0
        assert sample(second, "relax_workers_live", role="rollout") == 2.0
        assert sample(second, "relax_dead_letters") == 1.0
        # A step of 3 groups one version old and 1 group four versions old, then 2 groups at lag 0.
        sink.observe(Metric(run=RUN, step=3, values={"lag_1": 3.0, "lag_4": 1.0}))
        sink.observe(Metric(run=RUN, step=4, values={"lag_0": 2.0}))
        sink.observe(with_samples(5))  # a namespaced name is a label value; NaN is a sample value
        third = scrape(sink.port)
        assert sample(third, "relax_step_value", name="reward/correct/mean") == 1.0
        assert math.isnan(sample(third, "relax_step_value", name="policy/neg_logprob_mean"))
        assert sample(third, "relax_group_lag_count") == 6.0
        assert sample(third, "relax_group_lag_sum") == 7.0
        assert sample(third, "relax_group_lag_bucket", le="0.0") == 2.0
        assert sample(third, "relax_group_lag_bucket", le="1.0") == 5.0
        assert sample(third, "relax_group_lag_bucket", le="3.0") == 5.0
        assert sample(third, "relax_group_lag_bucket", le="4.0") == 6.0
    finally:
        sink.close()


def test_the_config_picks_the_sinks(tmp_path):
    default = parse_config({"run": RUN}).metrics
    sinks = open_sinks(default, tmp_path / "a", "config-sinks")  # not RUN: one W&B run id per process here
    try:
        assert [s.name for s in sinks] == ["jsonl", "samples", "tensorboard", "wandb"]
    finally:
        for sink in sinks:
            sink.close()
    assert default.prometheus_port == "auto" and default.wandb.enabled and default.wandb.mode == "offline"
    assert parse_config({"run": RUN, "metrics": {"prometheus_port": None}}).metrics.prometheus_port is None
    with pytest.raises(ConfigError, match="prometheus_port"):
        parse_config({"run": RUN, "metrics": {"prometheus_port": 0}})
    only_jsonl = parse_config({"run": RUN, "metrics": {"tensorboard": False, "wandb": {"enabled": False}}}).metrics
    assert [s.name for s in open_sinks(only_jsonl, tmp_path / "b", RUN)] == ["jsonl", "samples"]
    no_samples = only_jsonl.model_copy(update={"samples_per_step": 0})
    assert [s.name for s in open_sinks(no_samples, tmp_path / "c", RUN)] == ["jsonl"]


def test_what_a_launch_resolves_reaches_the_role_not_the_stored_config(tmp_path, monkeypatch):
    config = parse_config({"run": RUN})
    stored = config.model_dump()
    launch = metrics_launch(config, tmp_path / "run")
    assert config.model_dump() == stored and config.metrics.prometheus_port == "auto"  # what the user wrote
    assert launch is not None and launch.dir == str((tmp_path / "run").resolve())
    assert launch.prometheus_port is not None and 1 <= launch.prometheus_port <= 65535
    assert f"Prometheus http://127.0.0.1:{launch.prometheus_port}/metrics" in (metrics_sinks_line(config, launch) or "")
    for name, value in launch.environment().items():  # how `relax run` hands them to the metrics process
        monkeypatch.setenv(name, value)
    in_role = MetricsLaunch()
    assert in_role == launch
    assert prometheus_port(config.metrics, in_role) == launch.prometheus_port
    assert metrics_dir(config.metrics, tmp_path / "cache", in_role) == (tmp_path / "run").resolve()
    # What the user wrote wins, and without `relax run` an `auto` port is the system's pick (0).
    fixed = parse_config({"run": RUN, "metrics": {"prometheus_port": 9464, "out_dir": str(tmp_path / "m")}})
    assert metrics_launch(fixed, tmp_path / "run") == MetricsLaunch(dir=None, prometheus_port=None)
    assert prometheus_port(fixed.metrics, in_role) == 9464
    assert metrics_dir(fixed.metrics, tmp_path / "cache", in_role) == tmp_path / "m"
    monkeypatch.delenv("RELAX_METRICS_PROMETHEUS_PORT")
    monkeypatch.delenv("RELAX_METRICS_DIR")
    assert prometheus_port(config.metrics, MetricsLaunch()) == 0
    assert metrics_dir(config.metrics, tmp_path / "cache", MetricsLaunch()) == tmp_path / "cache" / "metrics"


def evaluation(version: int, accuracy: float = 0.5) -> EvalPoint:
    values = {"eval/greedy_accuracy": accuracy, "eval/pass_at_k": 0.75, "eval/version": float(version)}
    return EvalPoint(version, 1000.0 + version, values)


def feed_evals(sink, versions) -> int:
    written = sink.write_evals(evaluation(v, v / 100) for v in versions)
    sink.flush()
    return written


def test_jsonl_writes_each_evaluation_once_across_a_restart(tmp_path):
    first = JsonlSink(tmp_path / "metrics.jsonl")
    assert feed_evals(first, [0, 10, 10, 20]) == 3  # the same version twice (a redelivered event) is written once
    first.close()
    again = JsonlSink(tmp_path / "metrics.jsonl")
    assert again.last_eval == 20 and again.last_step == -1  # evaluations are not steps
    assert feed_evals(again, [10, 20, 30]) == 1
    again.close()
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [r["eval/version"] for r in rows] == [0, 10, 20, 30]
    assert rows[-1]["eval/greedy_accuracy"] == pytest.approx(0.3) and rows[-1]["at"] == 1030.0
    assert not (tmp_path / "metrics.jsonl").read_text()


def test_tensorboard_evaluations_are_at_their_version_and_apart_from_the_steps(tmp_path):
    first = TensorBoardSink(tmp_path)
    feed(first, [1, 2, 3])
    feed_evals(first, [0, 10, 20])
    first.close()
    again = TensorBoardSink(tmp_path)
    assert (again.last_step, again.last_eval) == (3, 20)  # the versions never pass for steps
    assert feed_evals(again, [20, 30]) == 1
    again.close()
    series = sorted(tensorboard_series(tmp_path / "eval", "eval/greedy_accuracy"))  # two files: in either order
    assert [s for s, _ in series] == [0, 10, 20, 30]
    assert [v for _, v in series] == pytest.approx([0.0, 0.1, 0.2, 0.3])


def wandb_run_record(wandb_dir: Path) -> list[Record]:
    """The `run` records (id, project, group, config) of the offline runs under `wandb_dir`."""
    out = []
    for path in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        out += [r for r in wandb_records(path) if r.WhichOneof("record_type") == "run"]
    return out


def test_wandb_honours_the_environment_and_holds_the_run_config(tmp_path, monkeypatch):
    """WANDB_DIR, WANDB_PROJECT, WANDB_RUN_GROUP, WANDB_TAGS and WANDB_MODE win over `metrics.wandb`; the offline run
    holds the whole run config and a run id of its own, kept across a restart of the role."""
    elsewhere = tmp_path / "wandb-dir"
    for name, value in {
        "WANDB_DIR": str(elsewhere),
        "WANDB_PROJECT": "from-env",
        "WANDB_RUN_GROUP": "sweep-1",
        "WANDB_TAGS": "a, b",
        "WANDB_MODE": "offline",
    }.items():
        monkeypatch.setenv(name, value)
    config = parse_config({"run": "wb-env", "metrics": {"wandb": {"mode": "online", "project": "from-config"}}})
    run_config = config.model_dump(mode="json")
    (first,) = open_sinks(config.metrics.model_copy(update={"jsonl": False, "tensorboard": False}), tmp_path, "wb-env",
                          run_config)  # fmt: skip
    assert isinstance(first, WandbSink) and re.fullmatch(r"wb-env-[0-9a-f]{8}", first.run_id), first.run_id
    feed(first, [1, 2])
    feed_evals(first, [0, 0])
    first.close()
    again = WandbSink(tmp_path, "wb-env", config.metrics.wandb, WandbEnv(), run_config)
    assert (again.run_id, again.last_step, again.last_eval) == (first.run_id, 2, 0)
    feed_evals(again, [0, 10])
    again.close()
    assert not list((tmp_path / "wandb").glob("offline-run-*"))  # the files went to WANDB_DIR: only markers here
    deadline = time.monotonic() + 30  # wandb's service writes the files on its own time (`wandb_points_when`)
    while len(records := wandb_run_record(elsewhere / "wandb")) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)  # poll; asserted below
    assert len(records) == 2, records  # one per start of the role, both of the same run
    for record in records:
        run = record.run
        assert (run.run_id, run.project, run.run_group) == (first.run_id, "from-env", "sweep-1")
        assert list(run.tags) == ["a", "b"]
        stored = {u.key: json.loads(u.value_json) for u in run.config.update}
        assert {k: stored[k] for k in run_config} == run_config  # the whole run config, as the run has it
    history = [h for h in wandb_history_when(elsewhere / "wandb", 3) if "eval/version" in h]
    assert [h["eval/version"] for h in history] == [0, 10]  # each evaluated version once
    other = WandbSink(tmp_path / "other", "wb-env", config.metrics.wandb, WandbEnv(), run_config)
    other.close()
    assert other.run_id != first.run_id  # another run of the same name never writes into this one


def test_an_unusable_wandb_variable_is_refused_with_its_name(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    with pytest.raises(ConfigError, match="WANDB_MODE"):
        open_sinks(parse_config({"run": RUN}).metrics, tmp_path, RUN)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    (sink,) = open_sinks(parse_config({"run": RUN, "metrics": {"jsonl": False, "tensorboard": False}}).metrics,
                         tmp_path, RUN)  # fmt: skip
    feed(sink, [1, 2])
    sink.close()
    assert not list(tmp_path.rglob("offline-run-*"))  # disabled: no W&B files at all

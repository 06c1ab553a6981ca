"""Poison on the events stream: any role may publish there, and the readers must take whatever it holds.

The attack is a rollout worker's own user publishing raw msgpack to the run's events subject: a metric with
`version: inf` (the metrics role turned it into an int and crashed, again at every restart), one with
`lag_1: 1e12` (the Prometheus histogram observed it a trillion times: the role spun until SIGKILL), metrics
without `reward_mean` or `step` (`relax run`'s progress display raised KeyError and ended the whole run),
wrong types, huge strings and a step beyond the run. The metrics role and the launcher's display pass each
over (one log line) and go on writing the real steps."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest

from schemas import SCHEMA_VERSION, Metric, RunEvent
from tests.bus.test_auth import Secured, provisioned, secured  # noqa: F401 (`secured` is a fixture)
from tests.waiting import until
from workers.launch import launcher
from workers.launch.processes import RunProcesses
from workers.metrics.prometheus import PrometheusSink
from workers.metrics.sinks import open_sinks
from workers.roles.metrics import MetricsRole

pytestmark = [pytest.mark.bus, pytest.mark.timeout(180)]


def poison(run: str) -> list[dict[str, object]]:
    """The events a rogue role sends: each decodes as msgpack, none is within the schema's bounds."""
    metric = {"kind": "metric", "schema_version": SCHEMA_VERSION, "run": run, "at": time.time()}
    event = {"kind": "event", "schema_version": SCHEMA_VERSION, "run": run, "at": time.time()}
    return [
        {**metric, "step": 1, "values": {"reward_mean": 0.5, "version": math.inf}},
        {**metric, "step": 1, "values": {"reward_mean": 0.5, "lag_1": 1e12}},
        {**metric, "step": 1, "values": {"lag_1": 2.0, "version": -3.0}},
        {**metric, "step": 1, "values": {"reward_mean": "high"}},
        {**metric, "step": 1, "values": {"x" * 100_000: 1.0}},
        {**metric, "step": 1, "values": {f"k{i}": 1.0 for i in range(5000)}},
        {**metric, "step": 2**62, "values": {"reward_mean": 0.5}},
        {**metric, "values": {"reward_mean": 0.5}},
        {**event, "event": "e" * 100_000},
        {**event, "event": "warmup_done", "fields": {"warmup_steps": "x" * 300_000}},
        {**event, "event": "warmup_done", "fields": {"warmup_steps": math.inf, "nested": {"a": 1}}},
    ]


def passable(run: str, step: int) -> list[dict[str, object]]:
    """Events within the schema's bounds that still lack what a reader might expect: a metric of `step` without
    `reward_mean` (or anything else), a warm-up event without its fields, one with strings in them."""
    return [
        {"kind": "metric", "schema_version": SCHEMA_VERSION, "run": run, "step": step, "values": {}},
        {"kind": "event", "schema_version": SCHEMA_VERSION, "run": run, "event": "warmup_done"},
        {
            "kind": "event",
            "schema_version": SCHEMA_VERSION,
            "run": run,
            "event": "warmup_done",
            "fields": {"warmup_steps": "many", "warmup_accuracy": None},
        },
    ]


async def publish_raw(s: Secured, role: str, payloads: list[dict[str, object]]) -> None:
    """Publish each payload as `role` (its own user) to the run's events subject, as bytes nobody validated."""
    bus = await s.bus(role, name=f"{role}-attacker")
    subject = bus.topology.subject("events")
    for payload in payloads:
        await bus.js.publish(subject, msgpack.packb(payload))
    assert s.violations(f"{role}-attacker") == [], "the role may publish events: the reader must cope"


async def publish_step(bus, step: int) -> None:
    await bus.publish("events", Metric(run=bus.run, step=step, values={"reward_mean": step / 10, "version": step}))


def jsonl_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


async def test_the_metrics_role_passes_poison_over_and_keeps_writing(secured: Secured, tmp_path):  # noqa: F811
    s = secured
    await provisioned(s)
    actor = await s.bus("actor")
    bus = await s.bus("metrics")
    gauges = PrometheusSink(bus.run, "127.0.0.1", 0)
    role = MetricsRole(bus, "metrics", open_sinks(bus.config.metrics, tmp_path, bus.run), gauges, 0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(role.run(stop))

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{gauges.port}/metrics", timeout=10) as reply:
            return reply.read().decode()

    try:
        await publish_step(actor, 1)
        await until(lambda: jsonl_steps(tmp_path), lambda steps: steps == [1], 60, "step 1 written")
        await publish_raw(s, "rollout", poison(bus.run))
        await publish_step(actor, 2)

        def state() -> tuple[list[int], bool, int]:
            assert not task.done() or task.exception() is None, f"the metrics role died: {task.exception()!r}"
            # The role counts a batch's points once its sinks have written them: the file shows step 2 first.
            return jsonl_steps(tmp_path), task.done(), role.follower.counts["points"]

        await until(lambda: asyncio.to_thread(state), lambda st: st == ([1, 2], False, 2), 60, "step 2 past the poison")
        text = await asyncio.to_thread(scrape)
        assert 'relax_step{run="' in text and "relax_policy_version" in text
        assert "x" * 1000 not in text and "e" * 1000 not in text, "no series named by the attacker's strings"
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)
        for sink in role.sinks:
            sink.close()
        gauges.close()


async def test_the_progress_display_of_relax_run_takes_any_event(secured: Secured, tmp_path):  # noqa: F811
    """`relax run`'s event loop over the attacker's events, then the run's two real steps: the display shows them,
    and the summary counts the steps the actor trained."""
    s = secured
    admin = await provisioned(s)
    actor = await s.bus("actor")
    await publish_raw(s, "rollout", poison(admin.run) + passable(admin.run, 1))
    await publish_step(actor, 1)
    await publish_step(actor, 2)

    config = s.config.model_copy(update={"metrics": s.config.metrics.model_copy(update={"enabled": False})})
    processes = RunProcesses(config, s.server.url, tmp_path / "work", tmp_path / "logs")
    processes.get("actor").finished = True  # the run has ended: the loop leaves once both steps are in
    watch = launcher.Watch(processes, None, [], asyncio.Event(), admin)
    out = io.StringIO()
    summary = await asyncio.wait_for(launcher._follow(admin, config, watch, tmp_path, out), 60)

    shown = out.getvalue()
    assert summary["steps"] == 2 and summary["reward_end"] == 0.15, summary
    assert "warm-up: ? supervised steps, sampled accuracy ?" in shown, shown
    assert "step 2/2  reward 0.200" in shown, shown
    assert "x" * 1000 not in shown
    assert jsonl_steps(tmp_path) == [1, 1, 2], "the launcher's own metrics.jsonl holds what decoded"


def test_a_poison_metric_cannot_be_built_either():
    """The producer's side of the same bounds: the actor cannot publish them by mistake."""
    for values in ({"version": math.inf}, {"lag_1": 1e12}, {"step": -1.0}, {"bad key": 1.0}):
        with pytest.raises(ValueError):
            Metric(run="r", step=1, values=values)
    with pytest.raises(ValueError):
        RunEvent(run="r", event="e", fields={"s": "x" * (1 << 20)})
    assert math.isnan(Metric(run="r", step=1, values={"loss": math.inf}).values["loss"]), "a diverged loss is NaN"

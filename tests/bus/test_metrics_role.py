"""The metrics role against a real server: it follows the run's events from its durable consumer, and a
role that died (before or after acknowledging) and started again leaves every step (and its logged samples, and each
held-out evaluation) in its sinks once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from relax_bus.heartbeat import live_workers
from schemas import Metric, RunEvent, StepSample
from tests.bus.test_auth import provisioned, secured  # noqa: F401 (`secured` is a fixture)
from tests.waiting import until
from tests.workers.test_metrics_sinks import tensorboard_series
from workers.metrics.sinks import open_sinks
from workers.roles.metrics import MetricsRole

pytestmark = [pytest.mark.bus, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


async def publish_steps(bus, steps) -> None:
    for step in steps:
        logged = tuple(
            StepSample(group_id=f"g{i}", index=0, policy_version=step, prompt="1+1=", response="2", reward=1.0)
            for i in range(2)
        )
        point = Metric(run=bus.run, step=step, values={"reward_mean": step / 100}, samples=logged)
        await bus.publish("events", point)
        await bus.publish("events", RunEvent(run=bus.run, event="step_trained", fields={"step": step}))
        if step % 5 == 0:  # a held-out evaluation of version `step` (`eval.every: 5`)
            await bus.publish("events", evaluation(bus, step))


def evaluation(bus, version: int) -> RunEvent:
    fields = {"eval/version": version, "eval/greedy_accuracy": version / 100, "eval/pass_at_k": 0.5}
    return RunEvent(run=bus.run, event="eval", source="rollout", fields=fields)


def eval_versions(out: Path) -> list[int]:
    path = out / "eval.jsonl"
    return [json.loads(line)["eval/version"] for line in path.read_text().splitlines()] if path.is_file() else []


def jsonl_steps(out: Path, name: str = "metrics.jsonl") -> list[int]:
    path = out / name
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def start_role(bus, url: str, work: Path) -> subprocess.Popen[str]:
    args = ["worker", "metrics", "--run", bus.run, "--nats-url", url, "--work-dir", str(work)]
    return subprocess.Popen(
        [sys.executable, "-m", "workers.cli", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "RELAX_CONNECT_RETRY_S": "10"},
    )


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> str:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    out, _ = proc.communicate(timeout=60)
    return out


async def test_a_killed_and_restarted_metrics_role_writes_every_step_once(make_bus, settings, tmp_path):
    out = tmp_path / "metrics"
    bus = await make_bus(metrics={"out_dir": str(out)})
    url = settings.nats_url[0]
    await publish_steps(bus, range(1, 11))

    # A role that took events 1-10, wrote steps 1-5 to its sinks and died before acknowledging any.
    sinks = open_sinks(bus.config.metrics, out, bus.run)
    crashed = MetricsRole(bus, "metrics", sinks, None)
    await crashed.follower.open()
    batch = []
    while len(batch) < 20:
        batch += await crashed.follower.next_batch()
    crashed._write([m for _, m in batch if isinstance(m, Metric)][:5])
    for sink in sinks:
        sink.close()
    await crashed.follower.close()
    assert jsonl_steps(out) == list(range(1, 6))

    # The real role, rewound to its ack floor: 1-10 come again at once and in order (not after ack_wait,
    # behind 11-15), and 1-5 are not written again.
    proc = start_role(bus, url, tmp_path / "work")
    try:
        await until(lambda: live_workers(bus.workers), lambda b: any(w.role == "metrics" for w in b), 120, "heartbeat")
        await publish_steps(bus, range(11, 16))
        await until(lambda: jsonl_steps(out), lambda s: s and s[-1] == 15, 120, "steps up to 15")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        await publish_steps(bus, range(16, 26))  # while it is down
        await bus.publish("events", evaluation(bus, 20))  # the same evaluation again (a worker published it twice)
        await bus.publish("events", evaluation(bus, 10**9))  # forged: past the run's last step, passed over
        proc = start_role(bus, url, tmp_path / "work")
        await until(lambda: jsonl_steps(out), lambda s: s and s[-1] == 25, 120, "steps up to 25")
        consumer = bus.topology.consumer("events")
        stream = bus.topology.stream("events").name
        await until(
            lambda: bus.js.consumer_info(stream, consumer.durable),
            lambda i: not i.num_pending and not i.num_ack_pending,
            120,
            "every event acknowledged",
        )
    finally:
        log = stop(proc)
    assert proc.returncode == 0, log[-3000:]
    assert jsonl_steps(out) == list(range(1, 26))
    assert jsonl_steps(out, "samples.jsonl") == [s for s in range(1, 26) for _ in range(2)]  # each step's once
    series = tensorboard_series(out / "tensorboard", "reward_mean")
    assert [s for s, _ in series] == list(range(1, 26))
    assert eval_versions(out) == [5, 10, 15, 20, 25]  # each once, through two kills, a duplicate and a forgery
    evals = sorted(tensorboard_series(out / "tensorboard" / "eval", "eval/greedy_accuracy"))
    assert [s for s, _ in evals] == [5, 10, 15, 20, 25]
    # The events stream is limits-retention: the role's reading took nothing away from it.
    messages = (await bus.js.stream_info(stream)).state.messages
    assert messages == 50 + 5 + 2  # steps and samples, evaluations, the duplicate and the forgery


async def test_the_role_serves_prometheus_gauges_of_the_run(make_bus, tmp_path):
    """In process, with the run's real consumers and workers bucket behind the gauges."""

    from tests.workers.test_metrics_sinks import sample

    bus = await make_bus(metrics={"out_dir": str(tmp_path)})
    task, stop_role, role, scrape = _serve_gauges(bus, tmp_path)

    try:
        await publish_steps(bus, [1])
        await until(lambda: asyncio.to_thread(scrape), lambda t: sample(t, "relax_step") == 1.0, 90, "step 1")
        await publish_steps(bus, [2, 3])
        text = await until(lambda: asyncio.to_thread(scrape), lambda t: sample(t, "relax_step") == 3.0, 90, "step 3")
        assert sample(text, "relax_events_total", event="step_trained") == 3.0
        text = await until(
            lambda: asyncio.to_thread(scrape),
            lambda t: sample(t, "relax_workers_live", role="metrics") == 1.0,
            90,
            "its own heartbeat counted",
        )
        assert sample(text, "relax_queue_depth", hop="prompts") == 0.0
    finally:
        stop_role.set()
        await task
        _close(role)


async def test_under_its_own_user_the_role_reads_what_its_gauges_need(secured, tmp_path):  # noqa: F811
    """With `relax auth`'s per-role users: the durable, its rewind, the consumer and stream infos, the
    workers bucket, its heartbeat; the server refuses it nothing."""

    from tests.workers.test_metrics_sinks import sample

    s = secured
    await provisioned(s)
    actor = await s.bus("actor")
    await publish_steps(actor, [1, 2])
    bus = await s.bus("metrics")
    task, stop_role, role, scrape = _serve_gauges(bus, tmp_path)

    try:
        await until(
            lambda: asyncio.to_thread(scrape),
            lambda t: (
                sample(t, "relax_step") == 2.0
                and sample(t, "relax_workers_live", role="metrics") == 1.0
                and sample(t, "relax_queue_depth", hop="prompts") == 0.0
                and sample(t, "relax_dead_letters") == 0.0
            ),
            90,
            "steps, live workers, queue depths and dead letters on the endpoint",
        )
    finally:
        stop_role.set()
        await task
        _close(role)
    assert jsonl_steps(tmp_path) == [1, 2]
    assert s.errors["metrics"] == [], s.errors["metrics"]


def _serve_gauges(bus, tmp_path):
    """The metrics role with a Prometheus sink on a free loopback port: its task, stop event, sink and a scraper
    (the run label normalised to `sinks`)."""
    from workers.metrics.prometheus import PrometheusSink

    gauges = PrometheusSink(bus.run, "127.0.0.1", 0)
    role = MetricsRole(bus, "metrics", open_sinks(bus.config.metrics, tmp_path, bus.run), gauges, poll_s=0.2)
    stop_role = asyncio.Event()
    task = asyncio.create_task(role.run(stop_role))

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{gauges.port}/metrics", timeout=10) as reply:
            return reply.read().decode().replace(f'run="{bus.run}"', 'run="sinks"')

    return task, stop_role, role, scrape


def _close(role: MetricsRole) -> None:
    """What `serve` does after the role's loop: close its sinks (the W&B run finishes) and its endpoint."""
    for sink in role.sinks:
        sink.close()
    assert role.gauges is not None
    role.gauges.close()

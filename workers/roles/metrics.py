"""The metrics role: every step of the run, once, in each configured sink.

A follower role of the bus's loop (`relax_bus.follow`): the bus reads the run's events stream in order from
the role's durable consumer (rewound to its ack floor on start), heartbeats, and acknowledges each batch once
`MetricsRole.take` returns, which writes the batch's `Metric` events to the step sinks
(`workers.metrics.sinks`: JSON Lines, TensorBoard, W&B) and flushes them, with the held-out evaluations its
`eval` run events carry (`workers.metrics.evaluation`), kept by policy version. A restarted role reads again from
its ack floor and the sinks skip the steps they already hold, so nothing is lost or written twice. With a
Prometheus port configured it also serves the run's gauges (`workers.metrics.prometheus`), reading
queue depths, dead letters and live workers from the server every `metrics.poll_s` seconds.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import nats.errors

from relax_bus.bus import Bus
from relax_bus.cancel import cancel_and_wait
from relax_bus.errors import ConfigError
from relax_bus.follow import Followed, Follower
from relax_bus.heartbeat import live_workers
from relax_bus.log import get_logger
from schemas import Metric, RunEvent
from workers.config import MetricsConfig, MetricsLaunch
from workers.metrics.evaluation import EVAL_EVENT, eval_numbers, eval_version
from workers.metrics.prometheus import PrometheusSink
from workers.metrics.sinks import EvalPoint, StepSink, open_sinks
from workers.roles.serve import RoleContext

log = get_logger(__name__)

WANDB_SERVICE_VARIABLE = "WANDB_SERVICE"
"""Where wandb tells child processes the address of the service it started (`wandb.env.SERVICE`)."""


def metrics_dir(config: MetricsConfig, cache: Path, launch: MetricsLaunch | None = None) -> Path:
    """Where the file sinks write: the configured directory, else the one `relax run` gave this launch (its run
    directory), else `<work-dir>/<run>/metrics`."""
    if config.out_dir:
        return Path(config.out_dir)
    return Path(launch.dir) if launch is not None and launch.dir else cache / "metrics"


def prometheus_port(config: MetricsConfig, launch: MetricsLaunch | None = None) -> int | None:
    """The port to serve the gauges on: the configured one; for `auto` the one `relax run` picked for this launch,
    else 0 (the system picks one); None: no endpoint."""
    if config.prometheus_port != "auto":
        return config.prometheus_port
    return launch.prometheus_port if launch is not None and launch.prometheus_port else 0


async def serve(ctx: RoleContext) -> None:
    """`relax worker metrics`: write the run's steps to its sinks until stopped."""
    bus = ctx.connected
    config = bus.config.metrics
    launch = MetricsLaunch()  # what `relax run` resolved for this launch (RELAX_METRICS_*); unset by hand
    gauges = None
    if (port := prometheus_port(config, launch)) is not None:
        where = f"{config.prometheus_host}:{port or config.prometheus_port}"
        try:
            gauges = PrometheusSink(bus.run, config.prometheus_host, port)
        except OSError as err:  # deliberate: a port in use is the user's to fix, in one line
            raise ConfigError("metrics.prometheus_port", [f"cannot listen on {where}: {err.strerror}"]) from None
        log.info("prometheus_serving", url=f"http://{config.prometheus_host}:{gauges.port}/metrics")
    # A W&B service inherited from the parent process (one that used wandb itself) is not this role's: the
    # run id of a role killed while attached to it stays "in use" there, and the restarted role could not
    # open the run again. Each role process starts its own, which dies with it.
    os.environ.pop(WANDB_SERVICE_VARIABLE, None)
    run_config = bus.config.model_dump(mode="json")  # the whole run config, as W&B shows it with the run
    sinks = await asyncio.to_thread(open_sinks, config, metrics_dir(config, ctx.cache, launch), bus.run, run_config)
    try:
        await MetricsRole(bus, ctx.role, sinks, gauges, config.poll_s, bus.config.trainer.steps).run(ctx.stop)
    finally:
        for sink in sinks:
            await asyncio.to_thread(sink.close)
        if gauges is not None:
            gauges.close()


class MetricsRole:
    """The role's part of the follower loop: write each batch to every sink and flush; the Prometheus poll."""

    def __init__(
        self,
        bus: Bus,
        role: str,
        sinks: list[StepSink],
        gauges: PrometheusSink | None,
        poll_s: float = 5.0,
        steps: int | None = None,
    ) -> None:
        """`steps`: the run's last step; a metric of a later one is passed over (it would make the sinks skip
        every real step up to it)."""
        self.bus = bus
        self.steps = steps
        self.role = role
        self.sinks = sinks
        self.gauges = gauges
        self.poll_s = poll_s
        self.follower = Follower.for_role(bus, role, self.take)

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the events until `stop` is set (the batch in hand is written and acknowledged first)."""
        poll = asyncio.create_task(self._poll(), name="metrics-poll") if self.gauges is not None else None
        try:
            await self.follower.run(stop=stop)
        finally:
            if poll is not None:
                await cancel_and_wait(poll)
        log.info("metrics_stopped", **self.follower.counts, **asdict(self.follower.counters))

    async def take(self, batch: list[Followed]) -> None:
        """Write a batch's steps to every sink and flush, and update the gauges (the bus acknowledges it next)."""
        points = [m for _, m in batch if isinstance(m, Metric) and self._in_run(m)]
        evals = [p for _, m in batch if (p := eval_point(m)) is not None and self._eval_in_run(p)]
        written = await asyncio.to_thread(self._write, points, evals) if points or evals else {}
        if self.gauges is not None:
            for _, message in batch:
                if isinstance(message, Metric | RunEvent):
                    self.gauges.observe(message)
        counts = self.follower.counts
        counts["points"] += len(points)
        counts["evals"] += len(evals)
        for name, count in written.items():
            counts[f"written_{name}"] += count
        if points:  # a count: a whole number in bounds (`schemas.bounded`)
            self.follower.policy_version = int(points[-1].values.get("version", self.follower.policy_version or 0))

    def _in_run(self, point: Metric) -> bool:
        if self.steps is None or point.step <= self.steps:
            return True
        log.warning("metric_beyond_run", step=point.step, steps=self.steps)  # passed over: no sink writes it
        self.follower.counts["passed_over"] += 1
        return False

    def _eval_in_run(self, point: EvalPoint) -> bool:
        """An evaluation of a version past the run's last step is forged: writing it would make the sinks skip
        every real evaluation up to it."""
        if self.steps is None or point.version <= self.steps:
            return True
        log.warning("eval_beyond_run", version=point.version, steps=self.steps)
        self.follower.counts["passed_over"] += 1
        return False

    def _write(self, points: list[Metric], evals: Sequence[EvalPoint] = ()) -> dict[str, int]:
        """Write and flush `points` and `evals` to every sink (in a thread: W&B and file writes block)."""
        written = {}
        for sink in self.sinks:
            written[sink.name] = sink.write(points) + sink.write_evals(evals)
            sink.flush()
        return written

    async def _poll(self) -> None:
        """Every `poll_s`: queue depths of every consumer, dead letters held, live workers by role."""
        assert self.gauges is not None
        t, js = self.bus.topology, self.bus.js
        while True:
            depths = {}
            for c in t.consumers:
                try:
                    info = await js.consumer_info(t.stream(c.stream_key).name, c.durable, timeout=2.0)
                except (TimeoutError, nats.errors.Error):
                    continue  # tolerated: an outage or a consumer not made yet; the next poll reads it
                depths[c.stream_key] = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
            live = Counter({r.name: 0 for r in t.roles})
            dead: int | None = None
            try:
                dead = int((await js.stream_info(t.stream("dlq").name)).state.messages)
                live.update(b.role for b in await live_workers(self.bus.workers))
            except (TimeoutError, nats.errors.Error):
                pass  # tolerated as above: the gauges keep what was read last
            self.gauges.set_server_state(depths, live, dead)
            await asyncio.sleep(self.poll_s)


def eval_point(message: object) -> EvalPoint | None:
    """The held-out evaluation an `eval` run event carries; None for any other message (or one without a version)."""
    if not isinstance(message, RunEvent) or message.event != EVAL_EVENT:
        return None
    version = eval_version(message.fields)
    if version is None:
        log.warning("eval_event_without_version", source=message.source)
        return None
    return EvalPoint(version, message.at, eval_numbers(message.fields))

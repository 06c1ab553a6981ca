"""A Prometheus `/metrics` endpoint of one run: the latest step's values, event counters, and what the
server says about the run's queues and workers (read every `metrics.poll_s` seconds).

    relax_step                      last training step
    relax_policy_version            policy version after that step
    relax_reward_mean               mean reward of the step
    relax_lag_mean, relax_lag_max   staleness of the step's groups, in policy versions
    relax_rollout_tokens_per_s      generation throughput of the step's groups
    relax_train_seconds             time the step's update took
    relax_step_value{name}          every value of the last step's metric, by name
    relax_group_lag                 histogram of the trained groups' staleness (policy versions), every step
    relax_events_total{event}       run events seen, by name
    relax_groups_dropped_total      groups dropped for staleness (events seen by this process)
    relax_groups_requeued_total     groups requeued for staleness (events seen by this process)
    relax_dead_letters              messages held in the run's dead-letter stream
    relax_queue_depth{hop}          messages waiting or unacknowledged on each consumer
    relax_workers_live{role}        workers whose heartbeat is current, by role

Counters start at zero with the process, as Prometheus counters do; gauges are the run's state.
Every metric carries the label `run`. The registry is the sink's own (not the process-global one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from relax_bus.log import get_logger
from schemas import Metric, RunEvent
from schemas.bounded import lag_of

log = get_logger(__name__)

_STEP_GAUGES = {
    "version": ("relax_policy_version", "Policy version after the last step."),
    "reward_mean": ("relax_reward_mean", "Mean reward of the last step."),
    "lag_mean": ("relax_lag_mean", "Mean staleness of the last step's groups, in policy versions."),
    "lag_max": ("relax_lag_max", "Largest staleness of the last step's groups, in policy versions."),
    "rollout_tokens_per_s": ("relax_rollout_tokens_per_s", "Generation throughput of the last step's groups."),
    "train_s": ("relax_train_seconds", "Seconds the last step's update took."),
}


LAG_BUCKETS = (0, 1, 2, 3, 4, 8, 16, 32, 64, float("inf"))
"""Upper bounds of the lag histogram's buckets: every small lag on its own, then doubling."""


MAX_SERIES = 256
"""Most label values (metric names, event names) a labelled metric takes; later ones are not exported."""


class _Labels:
    """The label values a labelled metric has taken, at most `MAX_SERIES`: the events stream is written by every
    role, and each new name would otherwise be a series kept for the life of the process."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.seen: set[str] = set()
        self.refused = 0

    def admit(self, value: str) -> bool:
        if value in self.seen:
            return True
        if len(self.seen) < MAX_SERIES:
            self.seen.add(value)
            return True
        if not self.refused:  # once: the names past the bound are not news
            log.warning("prometheus_series_bound", what=self.what, bound=MAX_SERIES, name=value[:64])
        self.refused += 1
        return False


def _observe_times(histogram: Any, value: float, times: int) -> None:
    """`histogram.observe(value)` `times` times, in one update (a step's lag counts are bounded, not small)."""
    histogram._sum.inc(value * times)
    for i, bound in enumerate(histogram._upper_bounds):
        if value <= bound:
            histogram._buckets[i].inc(times)
            break


class PrometheusSink:
    """Gauges and counters of one run, served over HTTP from a thread of the metrics process."""

    def __init__(self, run: str, host: str, port: int) -> None:
        self.run = run
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, ["run"]
        self.step = Gauge("relax_step", "Last training step.", labels, registry=r)
        self.gauges = {key: Gauge(name, doc, labels, registry=r) for key, (name, doc) in _STEP_GAUGES.items()}
        self.values = Gauge("relax_step_value", "Every value of the last step's metric.", [*labels, "name"], registry=r)
        self.events = Counter("relax_events", "Run events seen, by name.", [*labels, "event"], registry=r)
        self.dropped = Counter("relax_groups_dropped", "Groups dropped for staleness.", labels, registry=r)
        self.requeued = Counter("relax_groups_requeued", "Groups requeued for staleness.", labels, registry=r)
        self.dead_letters = Gauge("relax_dead_letters", "Messages in the dead-letter stream.", labels, registry=r)
        self.depth = Gauge("relax_queue_depth", "Messages waiting or unacknowledged.", [*labels, "hop"], registry=r)
        self.live = Gauge("relax_workers_live", "Workers with a current heartbeat.", [*labels, "role"], registry=r)
        self.lag = Histogram(
            "relax_group_lag",
            "Staleness of each trained group, in policy versions.",
            labels,
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self._value_names, self._event_names = _Labels("relax_step_value"), _Labels("relax_events_total")
        self._server: Any
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def observe(self, event: Metric | RunEvent) -> None:
        """Take one event of the run into the gauges and counters."""
        if isinstance(event, Metric):
            self.step.labels(self.run).set(event.step)
            for key, value in event.values.items():
                if self._value_names.admit(key):
                    self.values.labels(self.run, key).set(value)
                if key in self.gauges:
                    self.gauges[key].labels(self.run).set(value)
                if (lag := lag_of(key)) is not None:  # lag_<k>: how many of the step's groups were k versions old
                    _observe_times(self.lag.labels(self.run), lag, int(value))
            return
        if self._event_names.admit(event.event):
            self.events.labels(self.run, event.event).inc()
        if event.event == "group_dropped":
            self.dropped.labels(self.run).inc()
        elif event.event == "group_requeued":
            self.requeued.labels(self.run).inc()

    def set_server_state(self, depths: dict[str, int], live: Mapping[str, int], dead_letters: int | None) -> None:
        """The queue depths by hop, live workers by role and dead letters last read from the server."""
        for hop, depth in depths.items():
            self.depth.labels(self.run, hop).set(depth)
        for role, count in live.items():
            self.live.labels(self.run, role).set(count)
        if dead_letters is not None:
            self.dead_letters.labels(self.run).set(dead_letters)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

"""A real run for end-to-end tests: a nats-server, every role a `relax worker` process, and accounting."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.js.errors

from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.envelope import open_message
from relax_bus.outage import through_outage
from relax_bus.provision import provision_when_ready
from relax_bus.settings import ConnectionSettings
from schemas import Message, Metric, RunEvent, TrainGroup
from tests.waiting import until
from workers.config import PipelineConfig, task_seed, task_spec
from workers.data.tasks import load_task
from workers.launch.processes import RoleProcess, RunProcesses
from workers.roles.feeder import group_id_for


def small_config(run: str, **overrides: Any) -> dict[str, Any]:
    """A run that takes seconds: 4 groups x 4 samples per step, no warm-up, checkpoints every 2 steps; nested
    sections of `overrides` merge over these at every depth."""
    data: dict[str, Any] = {
        "run": run,
        "groups_per_step": 4,
        "samples_per_group": 4,
        "staleness": {"max_staleness": 1},
        "model": {"source": "tiny:64x2"},
        "task": {"type": "addition", "options": {"seed": 1}},
        "rollout": {"max_new_tokens": 3, "batch_groups": 4},
        "trainer": {"steps": 8, "optim": {"lr": 1e-3}, "checkpoint": {"every": 2}, "warmup": {"max_steps": 0}},
        "bus": {"ack_wait_s": 4, "heartbeat_ttl_s": 3, "duplicate_window_s": 600},
    }
    return merged(data, overrides)


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` laid over it, section by section at every depth (`trainer.checkpoint.dir` keeps
    `trainer.checkpoint.every`)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def role_events(role: RoleProcess, name: str) -> list[dict[str, Any]]:
    """The events called `name` in a role's JSON log (every incarnation), oldest first."""
    return [e for e in log_events(role.log_path) if e.get("event") == name]


def log_events(path: Path) -> list[dict[str, Any]]:
    """Every event of a role's JSON log (every incarnation), oldest first. A line cut short by a SIGKILL, or any
    other text, is skipped."""
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            found.append(event)
    return found


def kill_after_step(step: int, role: str, index: int = 0) -> Callable[[Cluster], Awaitable[None]]:
    """A run's scenario: SIGKILL worker `index` of `role` once the actor has recorded `step`."""

    async def scenario(cluster: Cluster) -> None:
        await cluster.wait_step(step)
        cluster.kill(role, index)

    return scenario


async def replace_the_rollout_worker(cluster: Cluster, after_step: int = 3) -> tuple[RoleProcess, dict[str, Any]]:
    """SIGKILL the run's only rollout worker once `after_step` is recorded and start a new one in its place (stopped
    with the cluster); returns it and its first `weights_loaded` event, checked to name the version current at the
    kill or a newer one."""
    first = cluster.role("rollout")
    joiner = RoleProcess("rollout", 1, first.command, first.log_path.with_name("rollout-1.log"))
    await cluster.wait_step(after_step)
    cluster.kill("rollout")  # the run has no rollout worker until the new one joins
    assert cluster.bus is not None
    current, _ = await cluster.bus.version.get()
    # Without a rollout worker the run trains at most the groups the feeder released by then, max_staleness + 1
    # steps past the version at the kill: a run that was that close to its end needs no joiner at all.
    steps, lead = cluster.config.trainer.steps, (cluster.config.staleness.max_staleness or 0) + 1
    assert current + lead < steps, f"the run was at v{current} of {steps} steps at the kill: give it more steps"
    cluster.spares.append(joiner)
    joiner.start()
    loaded = await until(lambda: role_events(joiner, "weights_loaded"), bool, 120, "the new worker's first load")
    assert loaded[0]["version"] >= max(current, 1), f"joined at v{current}, first loaded {loaded}"
    return joiner, loaded[0]


@dataclass
class Cluster:
    """Every role of one run as a separate process."""

    url: str
    config: PipelineConfig
    work: Path
    processes: RunProcesses
    bus: Bus | None = None
    spares: list[RoleProcess] = field(default_factory=list)
    """Processes a test started beside the run's own (stopped with them)."""

    @property
    def roles(self) -> list[RoleProcess]:
        return self.processes.roles

    @classmethod
    async def start(
        cls,
        url: str,
        config: PipelineConfig,
        work: Path,
        settings: ConnectionSettings | None = None,
        role_env: dict[str, dict[str, str]] | None = None,
    ) -> Cluster:
        """Provision (over `settings`, default: no credentials) and start every role, each with its
        `role_env[name]` (its own NATS credentials, say) added to the environment."""
        nc = await connect(settings or ConnectionSettings(nats_url=url.split(",")), name="e2e")
        await provision_when_ready(nc.jetstream(), config, wait_s=30.0)  # a fresh cluster elects its leader first
        processes = RunProcesses(config, url, work / "cache", work / "logs", role_env)
        cluster = cls(url, config, work, processes, await Bus.attach(nc, config.run, PipelineConfig))
        processes.start()
        return cluster

    def role(self, name: str, index: int = 0) -> RoleProcess:
        return self.processes.get(name, index)

    def kill(self, name: str, index: int = 0) -> None:
        """SIGKILL a role process by its PID, as a crash would."""
        self.processes.kill(name, index)

    def restart(self, name: str, index: int = 0) -> None:
        """Start a role again (after a kill or a crash), as a supervisor would."""
        self.processes.restart(name, index)

    async def stuck(self) -> dict[str, tuple[int, int]]:
        """`hop -> (pending, unacked)` for every hop consumer that still holds messages."""
        assert self.bus is not None
        out = {}
        for c in self.bus.topology.consumers:
            info = await self.bus.js.consumer_info(self.bus.topology.stream(c.stream_key).name, c.durable)
            pending, unacked = int(info.num_pending or 0), int(info.num_ack_pending or 0)
            if pending or unacked:
                out[c.stream_key] = (pending, unacked)
        return out

    async def kv_int(self, key: str) -> int:
        assert self.bus is not None
        try:
            entry = await through_outage(lambda: self.bus.state.get(key), f"read {key}", deadline_s=60.0)
            return int(entry.value or b"0")
        except nats.js.errors.KeyNotFoundError:
            return 0

    async def wait_step(self, step: int, timeout_s: float = 240.0) -> None:
        """Wait until the actor has finished `step` steps; fail fast with logs when a role dies."""
        deadline = time.monotonic() + timeout_s
        while await self.kv_int("trainer.step") < step:
            for r in self.roles:
                code = r.proc.poll() if r.proc and not r.finished else None
                if code not in (None, 0):
                    raise AssertionError(f"{r.name}-{r.index} died with {code}:\n{self.log_tail(r, 120)}")
            if time.monotonic() >= deadline:
                self.dump_stacks()
                raise AssertionError(f"step {step} not reached in {timeout_s}s\n{self.all_logs(lines=80)}")
            await asyncio.sleep(0.2)

    async def wait_done(self, timeout_s: float = 240.0) -> None:
        await self.wait_step(self.config.trainer.steps, timeout_s)
        actor = self.role("actor")
        assert actor.proc is not None
        code = await until(
            actor.proc.poll, lambda c: c is not None, 120, f"actor exit after its last step ({actor.log_path})"
        )
        assert code == 0, self.log_tail(actor)

    def log_tail(self, role: RoleProcess, lines: int = 30) -> str:
        return role.log_tail(lines) or "(no log)"

    def all_logs(self, lines: int = 15) -> str:
        return "\n".join(f"--- {r.name}-{r.index}\n{self.log_tail(r, lines)}" for r in self.roles)

    def dump_stacks(self) -> None:
        """Have every live role write its thread stacks into its log (SIGUSR1; torchrun launchers excepted)."""
        self.processes.dump_stacks()
        time.sleep(1.0)  # only on the way to a failure: give them a moment to write before the logs are read

    async def stop(self) -> None:
        for spare in self.spares:
            spare.stop()
        self.processes.stop(timeout_s=15)
        if self.bus is not None:
            await self.bus.nc.close()

    async def read(self, key: str) -> list[Message]:
        """Every message still in one of the run's streams, decoded."""
        assert self.bus is not None
        stream = self.bus.topology.stream(key).name
        st = (await self.bus.js.stream_info(stream)).state
        out = []
        for seq in range(st.first_seq, st.last_seq + 1) if st.messages else ():
            raw = await self.bus.js.get_msg(stream, seq)
            out.append(await open_message(raw.data or b"", raw.headers, self.bus.media))
        return out

    async def accounting(self) -> Accounting:
        events = await self.read("events")
        released = await self.kv_int("feeder.cursor")
        return Accounting.from_events(events, released, await self.read("train"), self.released_ids(released))

    def released_ids(self, released: int) -> list[str]:
        """The ids of the first `released` groups, as the feeder names them (epochs reshuffled when seeded)."""
        items, seed = load_task(task_spec(self.config.task)), task_seed(self.config.task)
        return [group_id_for(items, i, seed) for i in range(released)]


@dataclass
class Accounting:
    """Where every released prompt group ended up."""

    released: int
    released_ids: list[str]
    """The ids of the released groups, in release order."""
    effective: dict[int, list[str]]
    """step -> group ids of the step whose update survived (the last record of each step number)."""
    dropped: list[str]
    requeued: list[str]
    metrics: list[Metric]
    train_groups: list[TrainGroup]
    filtered: list[str] = field(default_factory=list)
    """Groups the reward role filtered (all rewards equal), once each: an event seen again after a redelivery
    names the same group."""

    @classmethod
    def from_events(cls, events: list[Message], released: int, train: list[Message], ids: list[str]) -> Accounting:
        effective: dict[int, list[str]] = {}
        dropped, requeued, filtered = [], [], {}
        for e in events:
            if isinstance(e, RunEvent) and e.event == "step_trained":
                effective[int(e.fields["step"])] = str(e.fields["groups"]).split(",")  # type: ignore[arg-type]
            elif isinstance(e, RunEvent) and e.event == "group_dropped":
                dropped.append(str(e.fields["group_id"]))
            elif isinstance(e, RunEvent) and e.event == "group_requeued":
                requeued.append(str(e.fields["group_id"]))
            elif isinstance(e, RunEvent) and e.event == "group_filtered":
                filtered[str(e.fields["group_id"])] = None
        metrics = [e for e in events if isinstance(e, Metric)]
        groups = [t for t in train if isinstance(t, TrainGroup)]
        return cls(released, ids, effective, dropped, requeued, metrics, groups, list(filtered))

    @property
    def trained(self) -> list[str]:
        return [g for step in sorted(self.effective) for g in self.effective[step]]

    def check_exactly_once(self, steps: int, groups_per_step: int) -> None:
        """Every released group trained exactly once, dropped or filtered; nothing trained twice or skipped."""
        trained = self.trained
        twice = [g for g, n in Counter(trained).items() if n > 1]
        assert not twice, f"trained twice: {twice}"
        assert sorted(self.effective) == list(range(1, steps + 1)), f"steps recorded: {sorted(self.effective)}"
        assert len(trained) == steps * groups_per_step
        settled = set(trained) | set(self.dropped) | set(self.filtered)
        assert not set(trained) & set(self.dropped), "a group was both trained and dropped"
        assert not set(trained) & set(self.filtered), "a group was both trained and filtered"
        missing = set(self.released_ids) - settled
        assert not missing, f"released but neither trained, dropped nor filtered: {sorted(missing)}"

"""Chaos in an agentic run: a rollout worker, then an environment server, SIGKILLed while they hold episodes.

One run, every role a process on a real nats-server, two rollout workers and two calculator servers whose every step
takes `LATENCY_S`, so episodes are in flight most of the time. The kills go to processes seen holding an episode:

- (a) a rollout worker that recorded a turn of an episode not finished yet (its records are in the run's episodes
  bucket). Its groups are redelivered once their ack wait expires, to the other worker, which resumes every episode
  from its last recorded turn: each trained sample counts the recorded turns as `resumed_turns`.
- (b) once those resumed groups are done, the environment server a step request was just sent to (the step takes
  `LATENCY_S`: it dies before answering). The client gets no reply, and the calculator being deterministic, the
  episode is replayed on the other server from its actions: the trained samples count `env_replays`. (Killed
  earlier, it could be answering the replay of a resumed episode's recorded actions at its opening: that opening
  is retried on the other server, not counted as a replay.)

Which process holds what is read off the wire: a core subscription sees the episodes bucket's puts and purges and the
rollout workers' heartbeat puts (a KV put is a request: its reply subject starts with the inbox prefix of the
connection that sent it, so a record and a heartbeat with the same prefix come from one process, whose pid the
heartbeat carries), and the step requests, whose subject names the server instance (its `env_serving` log event says
which process that is). Staleness is unbounded: a resumed or replayed group that waited out a kill is never dropped
as stale, so what it counts reaches the metrics. The run finishes with every released group trained exactly once.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import KeyNotFoundError

from relax_bus.ops.run_report import env_instances
from relax_bus.topology import Topology
from tests.e2e.cluster import Cluster, role_events
from tests.e2e.test_agentic_run import agentic_config
from tests.e2e.test_pipeline import run
from tests.waiting import until
from workers.config import parse_config
from workers.roles.episodes import EpisodeRecord

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(420)]

LATENCY_S = 0.3
"""Seconds every calculator step takes: a step request seen is a step not answered yet."""


def connection_of(reply: str | None) -> str:
    """The inbox prefix of the connection that sent a request (`_INBOX.<connection nuid>.<token>`)."""
    return (reply or "").rsplit(".", 1)[0]


@dataclass
class Watch:
    """The run's episode records, rollout heartbeats and environment steps, as they pass on the wire."""

    pids: dict[str, int] = field(default_factory=dict)
    """Connection -> pid of the rollout process it belongs to."""
    records: dict[str, str] = field(default_factory=dict)
    """Record key in the episodes bucket -> the connection that put it (removed when purged)."""
    steps: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    """The instance of every step request sent, in order."""
    subs: list[Subscription] = field(default_factory=list)

    async def start(self, nc: NATS, topology: Topology) -> Watch:
        episodes, workers = (f"$KV.{topology.bucket(b)}." for b in ("episodes", "workers"))

        async def on_record(msg: Msg) -> None:
            key = msg.subject.removeprefix(episodes)
            if (msg.headers or {}).get("KV-Operation") in ("PURGE", "DEL"):
                self.records.pop(key, None)
            else:
                self.records[key] = connection_of(msg.reply)

        async def on_heartbeat(msg: Msg) -> None:
            try:
                self.pids[connection_of(msg.reply)] = int(json.loads(msg.data)["pid"])
            except (ValueError, KeyError, TypeError):  # a heartbeat removed on stop has no body
                pass

        async def on_step(msg: Msg) -> None:
            self.steps.put_nowait(msg.subject.split(".")[-2])

        self.subs = [
            await nc.subscribe(f"{episodes}>", cb=on_record),
            await nc.subscribe(f"{workers}rollout.>", cb=on_heartbeat),
            await nc.subscribe(topology.env.step("*"), cb=on_step),
        ]
        await nc.flush()
        return self

    async def stop(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()

    def holders(self) -> dict[int, list[str]]:
        """pid -> record keys of the rollout processes that hold episodes with a recorded turn, now."""
        out: dict[int, list[str]] = {}
        for key, conn in list(self.records.items()):
            if conn in self.pids:
                out.setdefault(self.pids[conn], []).append(key)
        return out


async def kill_a_rollout_worker_mid_episode(cluster: Cluster, watch: Watch) -> tuple[int, dict[str, EpisodeRecord]]:
    """SIGKILL a rollout worker holding recorded episodes; its index and the records it left (by key). Should it have
    finished its episodes in the moment before the kill (none of its records is left), it is started again and the
    next one seen holding records is killed."""
    assert cluster.bus is not None
    kv = await cluster.bus.js.key_value(cluster.bus.topology.bucket("episodes"))
    for _ in range(5):
        index_of = {cluster.role("rollout", i).proc.pid: i for i in (0, 1)}  # type: ignore[union-attr]
        holders = await until(
            lambda: {pid: keys for pid, keys in watch.holders().items() if pid in index_of},  # noqa: B023
            bool,
            120,
            "a rollout worker holding recorded episodes",
        )
        pid, keys = next(iter(holders.items()))
        cluster.kill("rollout", index_of[pid])
        left = {}
        for key in keys:
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                continue
            if entry.value:
                left[key] = EpisodeRecord.from_bytes(entry.value)
        if left:
            return index_of[pid], left
        cluster.restart("rollout", index_of[pid])
    raise AssertionError("every rollout worker killed had finished its episodes just before the kill")


async def test_killed_rollout_worker_and_env_server_mid_episode(nats_server, tmp_path):
    config = parse_config(
        agentic_config(
            f"agchaos{uuid.uuid4().hex[:8]}",
            agent={"env": {"type": "calculator", "options": {"latency_s": LATENCY_S}}, "step_timeout_s": 5},
            rollout={"batch_groups": 2},
            staleness={"max_staleness": "unbounded"},
            trainer={"steps": 12},
            roles={"rollout": 2, "env": 2},
        )
    )
    killed: dict[str, int] = {}
    victims: list[str] = []
    orphans: dict[str, EpisodeRecord] = {}

    async def scenario(cluster: Cluster) -> None:
        assert cluster.bus is not None
        watch = await Watch().start(cluster.bus.nc, cluster.bus.topology)
        try:
            # (a) a rollout worker with recorded episodes; the other resumes them once they are redelivered, and
            # purges their records when their groups are generated
            killed["rollout"], left = await kill_a_rollout_worker_mid_episode(cluster, watch)
            orphans.update(left)
            victims.append(role_events(cluster.role("rollout", killed["rollout"]), "worker_started")[-1]["worker"])
            await until(lambda: set(orphans) & set(watch.records), lambda o: not o, 120, "the orphans resumed and done")
            # (b) the server a step was just sent to: a policy turn's step (a resumed episode's recorded actions,
            # replayed on its opening, are done), which is replayed on the other server
            instances = {role_events(cluster.role("env", i), "env_serving")[-1]["instance"]: i for i in (0, 1)}
            while not watch.steps.empty():
                watch.steps.get_nowait()
            killed["env"] = instances[await asyncio.wait_for(watch.steps.get(), 60)]
            cluster.kill("env", killed["env"])
            print(
                f"killed rollout-{killed['rollout']} holding {len(orphans)} recorded episodes, then env-{killed['env']}"
            )
        finally:
            await watch.stop()

    cluster = await run(nats_server, tmp_path, config, scenario)
    try:
        victim = victims[-1]
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        summed = {
            name: sum(m.values.get(name, 0.0) for m in acc.metrics)
            for name in ("episode_resumed_turns", "env_replays", "env_errors", "episode_tool_calls_mean")
        }
        print(f"summed over the run's steps: {summed}")
        assert summed["episode_resumed_turns"] > 0 and summed["env_replays"] > 0, summed
        # (a) Every episode the killed worker left was resumed from its record, by another worker: the trained sample
        # counts the recorded turns as resumed, and goes on from them.
        trained = {g.group_id: g for g in acc.train_groups if g.group_id in set(acc.trained)}
        for record in orphans.values():
            group, _, sample = record.episode.rsplit("/", 2)
            assert group in trained, f"{record.episode}: its group was not trained"
            rollout = trained[group].scored.rollout
            info = rollout.samples[int(sample)].episode
            assert info is not None and info.resumed_turns == record.turns, (record.episode, record.turns, info)
            assert info.turns >= record.turns and rollout.worker_id != victim, (record.episode, rollout.worker_id)
        # (b) Episodes were replayed on the other server; an episode that met an environment error says why it
        # ended.
        samples = [s for g in trained.values() for s in g.scored.rollout.samples]
        assert sum(s.episode.replays for s in samples if s.episode is not None) == summed["env_replays"]
        failed = [s.episode for s in samples if s.episode is not None and s.episode.env_errors]
        assert all(e.ended in ("env_error", "env_lost") for e in failed), failed
        left = await env_instances(cluster.bus.nc, config.run)
        assert len(left) == 1 and left[0]["endpoints"]["step"]["requests"] > 0, left
    finally:
        await cluster.stop()

"""Whole runs: every role a process, a real nats-server, a tiny model. Assertions come from the
streams, KV and the actor's step records, never from logs."""

from __future__ import annotations

import uuid

import pytest

from relax_bus.staleness import release_budget
from schemas import TrainGroup, WeightsAnnouncement
from tests.e2e.cluster import Cluster, kill_after_step, small_config
from tests.waiting import until
from workers.config import parse_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def run_id() -> str:
    return f"e2e{uuid.uuid4().hex[:8]}"


async def run(nats_server, tmp_path, config, scenario=None) -> Cluster:
    cluster = await Cluster.start(nats_server.url, config, tmp_path)
    try:
        if scenario is not None:
            await scenario(cluster)
        await cluster.wait_done()
    except BaseException:
        await cluster.stop()
        raise
    return cluster


async def test_on_policy_trains_only_lag_zero_and_respects_the_credit_rule(nats_server, tmp_path):
    config = parse_config(small_config(run_id(), staleness={"max_staleness": 0}))
    cluster = await run(nats_server, tmp_path, config)
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        assert len(acc.metrics) == config.trainer.steps
        assert all(m.values["lag_max"] == 0 for m in acc.metrics), [m.values["lag_max"] for m in acc.metrics]
        assert all(g.policy_version == g.scored.rollout.prompt.released_at_version for g in acc.train_groups)
        # Credit rule: a group was released only while the budget at its release allowed it.
        dropped = len(acc.dropped)
        for g in acc.train_groups:
            p = g.scored.rollout.prompt
            budget = release_budget(p.released_at_version, 0, config.groups_per_step, dropped)
            assert budget is not None and p.release_index < budget, (p.release_index, p.released_at_version)
        assert acc.released <= config.trainer.steps * config.groups_per_step + dropped
    finally:
        await cluster.stop()


async def test_unbounded_staleness_runs_ahead(nats_server, tmp_path):
    config = parse_config(
        small_config(
            run_id(), staleness={"max_staleness": "unbounded"}, trainer={"steps": 10, "warmup": {"max_steps": 0}}
        )
    )
    cluster = await run(nats_server, tmp_path, config)
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        assert max(m.values["lag_max"] for m in acc.metrics) > 0
        assert not acc.dropped
    finally:
        await cluster.stop()


async def test_two_rollout_and_two_reward_workers_share_the_work(nats_server, tmp_path):
    config = parse_config(small_config(run_id(), roles={"rollout": 2, "reward": 2}))
    cluster = await run(nats_server, tmp_path, config)
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        rollout_ids = {g.scored.rollout.worker_id for g in acc.train_groups}
        reward_ids = {g.scored.worker_id for g in acc.train_groups}
        assert len(rollout_ids) == 2, rollout_ids
        assert len(reward_ids) == 2, reward_ids
    finally:
        await cluster.stop()


async def test_kill_9_of_a_rollout_worker_loses_nothing(nats_server, tmp_path):
    config = parse_config(small_config(run_id(), roles={"rollout": 2}, trainer={"steps": 10}))

    cluster = await run(nats_server, tmp_path, config, kill_after_step(3, "rollout"))
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        # Whatever the dead worker held is redelivered when its ack wait expires and generated again. That can be
        # after the last step: prompts whose rollouts it published before dying unacked are not needed by the run.
        # The generation hops empty; nothing stays locked (the failure names hop -> (pending, unacked)).
        hops = ("prompts", "rollouts")
        await until(cluster.stuck, lambda stuck: not set(hops) & set(stuck), 60, f"the {' and '.join(hops)} hops empty")
        # The dead worker's prompts were generated again: a copy that reached the train stream after the last
        # step stays there untrained (the actor is done). Whatever the actor left is such a copy of a group it
        # trained (or dropped), never a group of its own.
        stream, durable = cluster.bus.topology.stream("train").name, cluster.bus.topology.consumer("train").durable
        floor = (await cluster.bus.js.consumer_info(stream, durable)).ack_floor.stream_seq
        groups = await cluster.read("train")  # the whole stream, in order (limits retention keeps what was acked)
        assert len(groups) == (await cluster.bus.js.stream_info(stream)).state.messages
        first = (await cluster.bus.js.stream_info(stream)).state.first_seq
        left = [g for seq, g in enumerate(groups, start=first) if seq > floor]
        settled = set(acc.trained) | set(acc.dropped)
        assert all(isinstance(g, TrainGroup) and g.group_id in settled for g in left), left
    finally:
        await cluster.stop()


async def test_kill_9_of_the_trainer_resumes_from_its_checkpoint(nats_server, tmp_path):
    config = parse_config(small_config(run_id(), trainer={"steps": 10, "checkpoint": {"every": 2}}))

    async def crash(cluster: Cluster) -> None:
        await cluster.wait_step(5)  # a checkpoint at step 4; step 5 is lost with the process
        cluster.kill("actor")
        actor = cluster.role("actor")
        actor.stop()
        actor.finished = False
        actor.start()

    cluster = await run(nats_server, tmp_path, config, crash)
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        record = await cluster.bus.state.get("trainer.checkpoint")
        assert b'"step": 10' in (record.value or b"")
        # Versions stay monotonic across the restart: no update number was announced twice. The kill lands
        # wherever the actor is once the step is seen, possibly between moving `policy.version` and announcing
        # it: that number stays taken and unannounced, and the restarted actor redoes the step under the next
        # one. So the record that survives for each step (the last one) names an announced version.
        announced = [e.version for e in await cluster.read("events") if isinstance(e, WeightsAnnouncement)]
        assert announced == sorted(set(announced)), announced
        surviving = {m.step: int(m.values["version"]) for m in acc.metrics}
        unannounced = {step: v for step, v in surviving.items() if v not in set(announced)}
        assert not unannounced, f"last records naming an unannounced version: {unannounced}; announced {announced}"
    finally:
        await cluster.stop()


async def test_fsdp2_trainer_on_two_ranks_under_torchrun(nats_server, tmp_path):
    root = tmp_path / "checkpoints"
    config = parse_config(
        small_config(run_id(), trainer={"steps": 4, "distributed": {"nproc": 2}, "checkpoint": {"dir": str(root)}})
    )
    cluster = await run(nats_server, tmp_path, config)
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        assert [int(m.values["version"]) for m in acc.metrics] == [1, 2, 3, 4]
        # Sharded checkpoints: each rank wrote its own shards of every one.
        assert sorted(p.name for p in (root / config.run).iterdir()) == ["ckpt-0", "ckpt-2", "ckpt-4"]
        shards = sorted(p.name for p in (root / config.run / "ckpt-4").iterdir())
        assert shards == [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)] + ["state.json"]
    finally:
        await cluster.stop()

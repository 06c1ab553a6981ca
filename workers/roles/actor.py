"""The actor role: assembles steps from the train stream, trains, publishes weights, then acks.

A batch role of the bus's worker loop (`relax_bus.batch_worker`), which fetches, keeps messages alive,
settles and shuts down. Per step the loop holds B admitted train groups: `admit` skips copies of groups
already trained (acked without training) and applies the run's staleness rule (`admit_fresh`: stale
groups are dropped or requeued); `handle` runs one optimizer update, snapshots the weights of version
v+1 and starts publishing them; the loop then acks the step's messages; `settled` records the step and
checkpoints. Order matters: a crash before the ack leaves the groups unacked, so they come back. A step whose update
raises is tried again up to `trainer.step_tries` times; then its groups are dead-lettered with the error (the feeder
replaces them, as any dead letter) and the actor goes on with the next batch instead of crash-looping on this one.
A failure after some of a step's updates (mini_batches > 1) leaves those updates in the weights.

Publishing is off the critical path: the snapshot (a copy of the weights) is handed to a task that
writes it through the weight transport and only then advances `policy.version` (compare-and-set) and
announces it, so a reader never sees a version it cannot fetch; meanwhile the acks, the step record and
the next step's collection go on. The next publish, a checkpoint and the end of the run wait for it
first, so versions are published in order and a checkpoint's version is always readable. A publish
that failed fails the actor at that wait (it restarts from its checkpoint, as after any crash).

Checkpoints (every `trainer.checkpoint.every` steps, and at step 0) go to the weights object store, or as
every rank's shards to `trainer.checkpoint.dir` (`workers.roles.actor_checkpoint`), with a record in KV:
model, optimizer, step, version, the train consumer's ack floor and the ledger of settled groups
(`workers.roles.ledger`). A restarted actor loads the latest, rewinds the consumer to the floor and skips
every group its ledger holds; so do copies of a group published again after a crash, wherever they land
in the stream: every group is trained exactly once in effect.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from relax_bus.batch_worker import BatchWorker, Held
from relax_bus.bus import Bus
from relax_bus.control import Reject, Skip
from relax_bus.delivery import Delivery, WorkerOptions
from relax_bus.log import get_logger
from relax_bus.outage import through_outage
from relax_bus.staleness import Decision
from schemas import Metric, RunEvent, TrainGroup
from workers.config import PipelineConfig, task_spec
from workers.roles.actor_checkpoint import ActorCheckpoints, checkpoint_record, clear_cut_off_dirs
from workers.roles.actor_media import ActorMedia
from workers.roles.actor_state import ActorState
from workers.roles.serve import RoleContext
from workers.roles.stages import announce_stage
from workers.roles.stale_groups import admit_fresh
from workers.roles.step_samples import step_samples
from workers.state_keys import GROUPS_DROPPED, TRAINER_DONE, TRAINER_STEP
from workers.training.devices import reads_ahead
from workers.training.distributed import DrivenTrainer, warm_up
from workers.training.judge_metrics import judge_metrics
from workers.training.step_metrics import (
    critic_metrics,
    episode_metrics,
    policy_aliases,
    response_metrics,
    reward_metrics,
)
from workers.training.trainer import PolicyTrainer
from workers.weights import WeightTransport

log = get_logger(__name__)

STEP_KEY = TRAINER_STEP
DONE_KEY = TRAINER_DONE


async def before_bus(ctx: RoleContext) -> bool:
    """Under torchrun, ranks > 0 mirror rank 0's trainer and never touch the bus; True if this was one."""
    from relax_bus.bus import Bus
    from workers.data.models import materialize
    from workers.training.devices import init_distributed
    from workers.training.distributed import follow, world

    init_distributed()
    rank, _ = world()
    if rank == 0:
        return False
    s = ctx.settings
    bus = await Bus.connect(
        s, ctx.run, name="relax-actor-follower", retry_for_s=s.connect_retry_s, config_model=PipelineConfig
    )
    config = bus.config  # the only thing a follower reads from the bus
    await bus.close()
    await asyncio.to_thread(dist.barrier)  # rank 0 has built (or found) the model directory: see serve
    model_dir = await asyncio.to_thread(materialize, config.model.source, ctx.cache / "base", config.model.seed)
    trainer = await asyncio.to_thread(PolicyTrainer, model_dir, config)
    await asyncio.to_thread(follow, trainer)
    return True


async def serve(ctx: RoleContext) -> None:
    """`relax worker actor` (rank 0 under torchrun): build the trainer, resume or warm up, train."""
    from workers.data.models import materialize
    from workers.data.tasks import load_task
    from workers.training.distributed import world
    from workers.training.sim_trainer import SimulatedTrainer
    from workers.weights import make_transport

    bus = ctx.connected
    cfg = bus.config
    _, size = world()
    await announce_stage(bus, "actor", "loading model")
    # Only rank 0 builds a model from code (transformers saves nothing on other ranks); they wait at this
    # barrier, the first collective of every rank, and then read the finished directory.
    model_dir = await asyncio.to_thread(materialize, cfg.model.source, ctx.cache / "base", cfg.model.seed)
    if size > 1:
        await asyncio.to_thread(dist.barrier)
    trainer_class = PolicyTrainer if cfg.trainer.simulate is None else SimulatedTrainer
    local = await asyncio.to_thread(trainer_class, model_dir, cfg)
    trainer = DrivenTrainer(local) if size > 1 else local
    actor = Actor(bus, trainer, make_transport(bus))

    async def body() -> None:
        try:
            await actor.setup(load_task(task_spec(cfg.task)))
            await announce_stage(bus, "actor", "waiting for the first groups", version=actor.state.version)
            await actor.run(ctx.stop)
        finally:
            if isinstance(trainer, DrivenTrainer):
                trainer.stop()

    async with actor.worker.alive():  # the heartbeat from the start: the warm-up can take minutes
        await body()


class Actor:
    """The actor as a batch role of the bus's loop; the math lives in `PolicyTrainer`."""

    def __init__(self, bus: Bus, trainer: PolicyTrainer | DrivenTrainer, transport: WeightTransport) -> None:
        self.bus = bus
        self.trainer = trainer
        self.transport = transport
        self.cfg = bus.config
        self.state = ActorState()
        self.revision = 0  # KV revision of policy.version we last wrote or read
        self.stream = bus.topology.stream("train").name
        self.durable = bus.topology.consumer("train").durable
        self.started = time.time()
        self.requeued = 0
        self.period_start: float | None = None  # perf_counter when the current step's period began
        self.worker = BatchWorker(
            bus,
            "actor",
            self,
            TrainGroup,
            lambda: self.cfg.groups_per_step,
            WorkerOptions(fetch_timeout_s=1.0),
            read_ahead=reads_ahead(self.cfg.trainer),
        )
        self._step: tuple[dict[str, float], collections.Counter[int], float] | None = None
        """Metrics, lags and weight-sync seconds of the step handled and not yet recorded."""
        self._publishing: asyncio.Task[float] | None = None
        """The weights publish in progress (its result: the seconds it took)."""
        self._publish_s: float | None = None
        """How long the last finished background publish took."""
        self._holding: set[int] = set()
        """Release indices of the groups held for the step being collected."""
        self.checkpoints = ActorCheckpoints(bus, trainer.checkpoints)
        self._first_trained = False
        """Whether this process has announced its first update (`workers.roles.stages`)."""
        judge = bus.config.judge
        self.judge_check = judge.check.label if judge is not None and judge.check is not None else None
        """The label of the rule logged beside the judge (`judge.check`), whose agreement with it each step reports."""
        self.media = ActorMedia(getattr(trainer, "prompter", None), bus.media)
        """Processor tensors of the held media groups (a multimodal policy)."""

    # ---- setup -------------------------------------------------------------------------------------------

    async def setup(self, warmup_items: list[Any]) -> None:
        """Resume from the latest checkpoint, or warm up and publish version 0."""
        # A predecessor SIGKILLed mid-upload (a checkpoint or a version) left chunks that nothing names.
        for store in (self.bus.weights, self.bus.checkpoints):
            orphans = await through_outage(store.clear_orphans, "clear cut-off uploads")
            if orphans:
                log.info("cut_off_uploads_cleared", store=store.bucket, uploads=orphans)
        record = await checkpoint_record(self.bus)
        cut = await asyncio.to_thread(clear_cut_off_dirs, self.bus, record)
        if cut:
            log.info("cut_off_checkpoints_cleared", dirs=cut)
        current, self.revision = await through_outage(self.bus.version.get, "read policy version")
        if record is not None:
            self.state = ActorState.from_extra(await self.checkpoints.restore(record))
            # Versions published after that checkpoint stay taken: the next update gets a new number.
            self.state.version = max(self.state.version, current)
            await self.worker.rewind(self.state.floor + 1)
            # Drops after the checkpoint are judged again (and counted again) as the consumer replays them.
            await self._put_dropped()
            log.info("actor_resumed", step=self.state.step, version=self.state.version, floor=self.state.floor)
            return
        if self.revision:
            # A previous actor published v0 but died before its first checkpoint: start from those weights.
            state = await self.transport.read(0)
            await asyncio.to_thread(self.trainer.load_full, state)
            self.state.version = current
            await self.worker.rewind(1)
        else:
            loop = asyncio.get_running_loop()

            def checked(fields: dict[str, float]) -> None:  # from the warm-up's thread: `relax run` sees progress
                asyncio.run_coroutine_threadsafe(self._event("warmup_progress", **fields), loop)

            if self.cfg.trainer.warmup.max_steps:
                await announce_stage(self.bus, "actor", "warming up", max_steps=self.cfg.trainer.warmup.max_steps)
            info = await asyncio.to_thread(warm_up, self.trainer, warmup_items, checked)
            log.info("warmup_done", **info)
            await self._event("warmup_done", **info)
            await self._publish_weights(0)
        await self._checkpoint()

    # ---- the loop: a batch role of the bus's worker loop ----------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        """Train until the run's steps are done (or `stop`); return the last step."""
        if self.state.step < self.cfg.trainer.steps:
            self.worker.policy_version = self.state.version
            if self.period_start is None:
                self.period_start = time.perf_counter()
            try:
                await self.worker.run(stop=stop)
            finally:
                await self._published()  # the last version is readable before the run says it is done
        await self.checkpoints.wait()  # and the last checkpoint is whole
        if self.state.step >= self.cfg.trainer.steps:
            await self._put(DONE_KEY, str(self.state.step))
            log.info("actor_done", step=self.state.step, version=self.state.version)
        return self.state.step

    async def admit(self, group: TrainGroup, delivery: Delivery, held: Sequence[Held[TrainGroup]]) -> None:
        """Hold a fresh group for the step; `Skip` a copy, and let the staleness rule drop or requeue."""
        attempt_key = f"{group.group_id}/{group.prompt.attempt}"
        index = group.prompt.release_index
        if not held:
            self._holding.clear()  # a new step's collection
        if index in self.state.trained or attempt_key in self.state.settled or index in self._holding:
            raise Skip()  # a copy (redelivered, or published again after a crash): exactly once in effect
        if (why := self.trainer.untrainable(group)) is not None:
            raise Reject(f"group {group.group_id} cannot be trained: {why}")  # dead-lettered; the feeder replaces it

        async def requeued(decision: Decision) -> None:
            self.state.settled.add(attempt_key)
            self.requeued += 1

        async def dropped(decision: Decision) -> None:
            # Counted in the checkpointed state (not the shared counter): a drop replayed after a restart
            # is counted once, and the whole count is written for the feeder's credit.
            self.state.settled.add(attempt_key)
            self.state.dropped += 1
            await self._put_dropped()
            await self._event("group_dropped", group_id=group.group_id, lag=decision.lag, reason=decision.reason)

        await admit_fresh(self.bus, group, self.state.version, requeued, dropped)
        await self.media.admit(group)  # held: its processor tensors, before the step needs them
        self._holding.add(index)

    async def handle(self, batch: Sequence[Held[TrainGroup]]) -> None:
        """One optimizer update on the step's groups, then the weights of the next version."""
        version = self.state.version
        lags = collections.Counter(version - h.message.policy_version for h in batch)
        # In release order, not arrival order: the update does not depend on which worker answered first.
        groups = sorted((h.message for h in batch), key=lambda g: g.prompt.release_index)
        metrics, snapshot, snapshot_s = await self._train(groups, version, self.media.take(groups))
        metrics = {**metrics, **self.media.metrics(groups)}
        sync_started = time.perf_counter()
        await self._published()  # v is readable before v+1 starts: versions advance in order
        self.state.version = version + 1  # what the next groups' lag is counted against, as before
        publish = self._publish_weights(version + 1, snapshot, self.state.step)
        self._publishing = asyncio.create_task(publish, name="publish-weights")
        self.worker.policy_version = self.state.version
        for g in groups:
            self.state.trained.add(g.prompt.release_index)
        if self._publish_s is not None:
            metrics = {**metrics, "weight_publish_s": self._publish_s}
        if self.checkpoints.save_s is not None and self.checkpoints.path_s is not None:
            metrics = {**metrics, "checkpoint_path_s": self.checkpoints.path_s, "checkpoint_s": self.checkpoints.save_s}
        self._step = (metrics, lags, snapshot_s + time.perf_counter() - sync_started)
        # The step's count goes up before its groups leave the train stream (the acks follow `handle`): whoever
        # counts groups on the bus and then groups trained (the feeder's dead-letter credit) never misses these.
        await self._put(STEP_KEY, str(self.state.step + 1))

    async def settled(self, batch: Sequence[Held[TrainGroup]]) -> None:
        """After the step's acks: record it, checkpoint on schedule, stop after the last step."""
        assert self._step is not None
        metrics, lags, weight_sync_s = self._step
        self.state.step += 1
        await self._record_step(batch, metrics, lags, weight_sync_s)
        if self.state.step % self.cfg.trainer.checkpoint.every == 0 or self.state.step == self.cfg.trainer.steps:
            await self._checkpoint()
        if self.state.step >= self.cfg.trainer.steps:
            self.worker.stop()

    async def _train(
        self, groups: list[TrainGroup], version: int, media: Any
    ) -> tuple[dict[str, float], dict[str, torch.Tensor], float]:
        """`_train_and_snapshot`, tried `trainer.step_tries` times; then `Reject`: the batch is dead-lettered."""
        tries, step = self.cfg.trainer.step_tries, self.state.step + 1
        if not self._first_trained:  # the first update (allocations, kernels' first run) can take a while
            self._first_trained = True
            await announce_stage(self.bus, "actor", f"training step {step}", groups=len(groups))
        error = ""
        for attempt in range(1, tries + 1):
            try:
                return await asyncio.to_thread(self._train_and_snapshot, groups, version, media)
            except Exception as err:  # deliberate: a batch the step cannot take must not crash-loop the actor
                error = f"{type(err).__name__}: {err}"
                log.warning("step_failed", step=step, attempt=attempt, tries=tries, error=error)
        for g in groups:  # settled: a copy of a dead-lettered group is skipped, as the feeder replaces it
            self.state.settled.add(f"{g.group_id}/{g.prompt.attempt}")
        reason = f"step {step} failed {tries} times on this batch, last: {error}"
        await self._event("step_dead_lettered", step=step, groups=",".join(g.group_id for g in groups), reason=reason)
        raise Reject(reason)

    def _train_and_snapshot(
        self, groups: list[TrainGroup], version: int, media: Any
    ) -> tuple[dict[str, float], dict[str, torch.Tensor], float]:
        """The update, then the snapshot of the new weights in the same thread hop; and the snapshot's seconds. (A
        publish slower than a step still holds its own snapshot meanwhile: two copies of the weights at most.)"""
        metrics = self.trainer.step(groups, version, media)
        started = time.perf_counter()
        snapshot = self._snapshot()
        return metrics, snapshot, time.perf_counter() - started

    def _snapshot(self) -> dict[str, torch.Tensor]:
        """The weights as they are now, in tensors of their own (on CPU `full_state` returns the parameters
        themselves, which the next step changes in place while the publish still reads them). With `trainer.lora`
        only the adapter: the base never changes, and v0 published it."""
        if self.cfg.trainer.lora is not None:
            return self.trainer.adapter_state()
        return {k: v.detach().clone() for k, v in self.trainer.full_state().items()}

    async def _publish_weights(
        self, version: int, state: dict[str, torch.Tensor] | None = None, step: int | None = None
    ) -> float:
        """Make `version` readable through the transport, then advance policy.version and announce it."""
        started = time.perf_counter()
        if state is None:
            state = await asyncio.to_thread(self.trainer.full_state)
        announcement = await self.transport.publish(version, state, self.state.step if step is None else step)
        self.revision = await self.bus.version.advance(version, self.revision)
        self.state.version = max(self.state.version, version)
        await self.bus.publish("events", announcement)
        return time.perf_counter() - started

    async def _published(self) -> None:
        """Wait for the publish in progress, if any (its failure is raised here)."""
        if self._publishing is not None:
            task, self._publishing = self._publishing, None
            self._publish_s = await task

    async def _record_step(
        self,
        held: Sequence[Held[TrainGroup]],
        metrics: dict[str, float],
        lags: collections.Counter[int],
        weight_sync_s: float,
    ) -> None:
        groups = [h.message for h in held]
        rollouts = [g.scored.rollout for g in groups]
        samples = [s for r in rollouts for s in r.samples]
        calls = {(r.worker_id, r.timings.generate_s) for r in rollouts}  # groups of one engine call share it
        gen_s = sum(seconds for _, seconds in calls)
        tokens = sum(s.token_ids.numel for s in samples)
        values = {
            **metrics,
            **policy_aliases(metrics),
            **reward_metrics(groups),
            **critic_metrics(groups),
            **response_metrics(samples),
            "step": float(self.state.step),
            "version": float(self.state.version),
            "wall_s": time.time() - self.started,
            "weight_sync_s": weight_sync_s,
            "dropped": float(self.state.dropped),
            "requeued": float(self.requeued),
            "lag_mean": sum(k * v for k, v in lags.items()) / max(1, len(held)),
            "lag_max": float(max(lags)),
            "rollout_tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
            **{f"lag_{k}": float(v) for k, v in sorted(lags.items())},
            **episode_metrics(samples),
            **judge_metrics([h.message for h in held], self.judge_check),
            **self._step_timings(),
        }
        template = self.cfg.judge.template if self.cfg.judge is not None else None
        shown = self.cfg.metrics
        logged = step_samples(groups, shown.samples_per_step, shown.sample_text_bytes, template)
        point = Metric(run=self.bus.run, step=self.state.step, values=values, samples=logged)
        await self.bus.publish("events", point)
        await self._event(
            "step_trained",
            step=self.state.step,
            groups=",".join(h.message.group_id for h in held),
            seqs=",".join(str(h.delivery.stream_seq) for h in held),
            versions=",".join(str(h.message.policy_version) for h in held),
        )
        log.info(
            "step_done",
            step=self.state.step,
            reward=round(metrics["reward_mean"], 3),
            loss=round(metrics["loss"], 4),
            lag=dict(lags),
        )

    def _step_timings(self) -> dict[str, float]:
        """This step's phase seconds and `step_s`, the time since the previous step was recorded; resets both.

        data_wait_s: collecting the step's groups (waiting for data, judging); admit_s: the dedupe / staleness part
        of it; ack_s: acknowledging the trained groups (sent, not confirmed); decode_s: fetching and decoding the
        groups as they arrive (with read_ahead 1, the next step's while this one trains, off the step's path).
        """
        now = time.perf_counter()
        phases = {"data_wait_s": 0.0, "admit_s": 0.0, "ack_s": 0.0, "decode_s": 0.0, **self.worker.timings}
        phases["read_ahead"] = float(self.worker.read_ahead)
        phases["step_s"] = now - (self.period_start if self.period_start is not None else now)
        self.worker.timings.clear()
        self.period_start = now
        return phases

    async def _checkpoint(self) -> None:
        """Snapshot model, optimizer, schedule and actor state now (at this step's ack floor) and save them in the
        background while the next steps train (`ActorCheckpoints`); the run's end (SIGTERM too) waits for it."""
        await self.checkpoints.wait()
        await self._published()  # the checkpoint's version is readable
        info = await through_outage(lambda: self.bus.js.consumer_info(self.stream, self.durable), "read ack floor")
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
        self.state.floor = floor
        await self.checkpoints.start(self.state.to_extra(), self.state.step, self.state.version, floor)

    async def _put_dropped(self) -> None:
        await self._put(GROUPS_DROPPED, str(self.state.dropped))

    async def _put(self, key: str, value: str) -> None:
        await self.bus.run_state.put(key, value.encode())

    async def _event(self, event: str, **fields: Any) -> None:
        await self.bus.publish("events", RunEvent(run=self.bus.run, event=event, source="actor", fields=fields))

"""The actor role: assembles steps from the train stream, trains, publishes weights, then acks.

Per step: fetch train groups until B fresh ones are held (stale ones are dropped or requeued by the
run's staleness rule; groups already trained are acked and skipped), run one optimizer update, publish
the weights of version v+1, compare-and-set `policy.version`, then ack the step's messages. Order
matters: a crash before the ack leaves the groups unacked, so they come back.

Checkpoints (every `trainer.checkpoint_every` steps, and at step 0) go to the weights object store
with a record in KV: model, optimizer, step, version, the train consumer's ack floor and the ids
settled above it. A restarted actor loads the latest, rewinds the consumer to the floor and skips
the ids it already settled, so every group is trained exactly once in effect.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from relax_bus.bus import Bus
from relax_bus.envelope import open_message
from relax_bus.errors import BlobCorrupt, BlobNotFound
from relax_bus.log import get_logger
from relax_bus.settle import dead_letter, term
from relax_bus.stale_filter import DROPPED_KEY, judge
from relax_bus.staleness import Verdict
from relax_bus.state_keys import TRAINER_CHECKPOINT, TRAINER_DONE, TRAINER_STEP
from schemas import Metric, RunEvent, SchemaError, TrainGroup
from workers.distributed import DrivenTrainer
from workers.trainer import PolicyTrainer
from workers.weights import WeightTransport

log = get_logger(__name__)

CHECKPOINT_KEY = TRAINER_CHECKPOINT
STEP_KEY = TRAINER_STEP
DONE_KEY = TRAINER_DONE


@dataclass
class Held:
    """A train message collected for the current step."""

    msg: Msg
    group: TrainGroup
    seq: int


@dataclass
class ActorState:
    """What survives a restart (inside each checkpoint)."""

    step: int = 0
    version: int = 0
    floor: int = 0
    """Train-stream sequence at or below which every message is settled."""
    trained: dict[str, int] = field(default_factory=dict)
    """group id -> stream seq of the message it was trained from (only seqs above `floor`)."""
    settled: dict[str, int] = field(default_factory=dict)
    """`group_id/attempt` -> stream seq, for groups dropped or requeued (only seqs above `floor`)."""
    dropped: int = 0
    """Groups dropped as stale in this history; written whole to `groups.dropped` (the feeder's credit)."""


class Actor:
    """The actor's loop over the bus; the math lives in `PolicyTrainer`."""

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

    # ---- setup -------------------------------------------------------------------------------------------

    async def setup(self, warmup_items: list[Any]) -> None:
        """Resume from the latest checkpoint, or warm up and publish version 0."""
        record = await self._checkpoint_record()
        current, self.revision = await self.bus.version.get()
        if record is not None:
            data = await self.bus.weights.get(record["object"])
            extra = await asyncio.to_thread(self.trainer.restore, data)
            self.state = ActorState(**extra)
            # Versions published after that checkpoint stay taken: the next update gets a new number.
            self.state.version = max(self.state.version, current)
            await self.bus.js.reset_consumer(self.stream, self.durable, seq=self.state.floor + 1)
            # Drops after the checkpoint are judged again (and counted again) as the consumer replays them.
            await self._put_dropped()
            log.info("actor_resumed", step=self.state.step, version=self.state.version, floor=self.state.floor)
            return
        if self.revision:
            # A previous actor published v0 but died before its first checkpoint: start from those weights.
            state = await self.transport.fetch(0)
            await asyncio.to_thread(self.trainer.load_full, state)
            self.state.version = current
            await self.bus.js.reset_consumer(self.stream, self.durable, seq=1)
        else:
            info = await asyncio.to_thread(self.trainer.warmup, warmup_items)
            log.info("warmup_done", **info)
            await self._event("warmup_done", **info)
            await self._publish_weights(0)
        await self._checkpoint()

    async def _checkpoint_record(self) -> dict[str, Any] | None:
        try:
            entry = await self.bus.state.get(CHECKPOINT_KEY)
        except nats.js.errors.KeyNotFoundError:
            return None
        return json.loads(entry.value or b"{}") or None

    # ---- the loop ----------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        """Train until the run's steps are done (or `stop`); return the last step."""
        sub = await self.bus.js.pull_subscribe_bind(self.durable, self.stream)
        try:
            while self.state.step < self.cfg.trainer.steps and not stop.is_set():
                held: list[Held] = []
                keepalive = asyncio.create_task(self._keep_alive(held))  # through collecting and training
                try:
                    if not await self._collect(sub, stop, held):
                        break
                    await self._train(held)
                finally:
                    keepalive.cancel()
        finally:
            await sub.unsubscribe()
        if self.state.step >= self.cfg.trainer.steps:
            await self.bus.state.put(DONE_KEY, str(self.state.step).encode())
            log.info("actor_done", step=self.state.step, version=self.state.version)
        return self.state.step

    async def _collect(self, sub: Any, stop: asyncio.Event, held: list[Held]) -> bool:
        """Fill `held` with a step's groups; False (messages handed back) when stopped first."""
        need = self.cfg.groups_per_step
        while len(held) < need:
            if stop.is_set():
                for h in held:
                    await h.msg.nak()
                return False
            try:
                msgs = await sub.fetch(need - len(held), timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            for msg in msgs:
                item = await self._admit(msg)
                if item is not None:
                    held.append(item)
        return True

    async def _admit(self, msg: Msg) -> Held | None:
        """Decode, dedupe and judge one train message; settle it unless it joins the step."""
        seq = msg.metadata.sequence.stream
        try:
            group = await open_message(msg.data, msg.headers, self.bus.media, TrainGroup)
        except (SchemaError, BlobNotFound, BlobCorrupt) as err:
            await dead_letter(self.bus, msg, f"undecodable train message: {err}", self.durable)
            return None
        assert isinstance(group, TrainGroup)
        attempt_key = f"{group.group_id}/{group.scored.rollout.prompt.attempt}"
        if group.group_id in self.state.trained or attempt_key in self.state.settled:
            await msg.ack()  # already settled before a restart: exactly once in effect
            return None
        decision = await judge(self.bus, group, self.state.version)
        if decision.verdict is Verdict.TRAIN:
            return Held(msg, group, seq)
        self.state.settled[attempt_key] = seq
        if decision.verdict is Verdict.REQUEUE:
            self.requeued += 1
            await msg.ack()
        else:
            self.state.dropped += 1
            await self._put_dropped()
            await term(self.bus, msg, decision.reason)
            await self._event("group_dropped", group_id=group.group_id, lag=decision.lag, reason=decision.reason)
        return None

    async def _keep_alive(self, held: list[Held]) -> None:
        interval = max(0.5, self.cfg.bus.ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            for h in list(held):
                try:
                    await h.msg.in_progress()
                except (nats.errors.Error, OSError):
                    pass  # tolerated: after a reconnect the server redelivers; dedupe catches it

    async def _train(self, held: list[Held]) -> None:
        version = self.state.version
        lags = collections.Counter(version - h.group.policy_version for h in held)
        metrics = await asyncio.to_thread(self.trainer.step, [h.group for h in held])
        sync_started = time.perf_counter()
        await self._publish_weights(version + 1)
        weight_sync_s = time.perf_counter() - sync_started
        for h in held:
            await h.msg.ack_sync()
            self.state.trained[h.group.group_id] = h.seq
        self.state.step += 1
        await self.bus.state.put(STEP_KEY, str(self.state.step).encode())
        await self._record_step(held, metrics, lags, weight_sync_s)
        if self.state.step % self.cfg.trainer.checkpoint_every == 0 or self.state.step == self.cfg.trainer.steps:
            await self._checkpoint()

    async def _publish_weights(self, version: int) -> None:
        state = await asyncio.to_thread(self.trainer.full_state)
        announcement = await self.transport.publish(version, state, self.state.step)
        self.revision = await self.bus.version.advance(version, self.revision)
        self.state.version = version
        await self.bus.publish("events", announcement)

    async def _record_step(
        self, held: list[Held], metrics: dict[str, float], lags: collections.Counter[int], weight_sync_s: float
    ) -> None:
        rollouts = [h.group.scored.rollout for h in held]
        calls = {(r.worker_id, r.timings.generate_s) for r in rollouts}  # groups of one engine call share it
        gen_s = sum(seconds for _, seconds in calls)
        tokens = sum(s.token_ids.numel for r in rollouts for s in r.samples)
        values = {
            **metrics,
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
        }
        await self.bus.publish("events", Metric(run=self.bus.run, step=self.state.step, values=values))
        await self._event(
            "step_trained",
            step=self.state.step,
            groups=",".join(h.group.group_id for h in held),
            seqs=",".join(str(h.seq) for h in held),
            versions=",".join(str(h.group.policy_version) for h in held),
        )
        log.info(
            "step_done",
            step=self.state.step,
            reward=round(metrics["reward_mean"], 3),
            loss=round(metrics["loss"], 4),
            lag=dict(lags),
        )

    async def _checkpoint(self) -> None:
        info = await self.bus.js.consumer_info(self.stream, self.durable)
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
        self.state.floor = floor
        self.state.trained = {k: v for k, v in self.state.trained.items() if v > floor}
        self.state.settled = {k: v for k, v in self.state.settled.items() if v > floor}
        extra = dict(vars(self.state))
        data = await asyncio.to_thread(self.trainer.checkpoint_bytes, extra)
        name = f"ckpt-{self.state.step}"
        await self.bus.weights.put(name, data)
        record = {"object": name, "step": self.state.step, "version": self.state.version, "floor": floor}
        old = await self._checkpoint_record()
        await self.bus.state.put(CHECKPOINT_KEY, json.dumps(record).encode())
        if old is not None and old["object"] != name:
            await self.bus.weights.delete(old["object"])
        log.info("checkpoint_saved", **record)

    async def _put_dropped(self) -> None:
        await self.bus.state.put(DROPPED_KEY, str(self.state.dropped).encode())

    async def _event(self, event: str, **fields: Any) -> None:
        await self.bus.publish("events", RunEvent(run=self.bus.run, event=event, source="actor", fields=fields))

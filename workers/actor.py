"""The actor role: assembles steps from the train stream, trains, publishes weights, then acks.

Per step: fetch train groups until B fresh ones are held (stale ones are dropped or requeued by the
run's staleness rule; groups already trained are acked and skipped), run one optimizer update, publish
the weights of version v+1, compare-and-set `policy.version`, then ack the step's messages. Order
matters: a crash before the ack leaves the groups unacked, so they come back.

Checkpoints (every `trainer.checkpoint_every` steps, and at step 0) go to the weights object store
with a record in KV: model, optimizer, step, version, the train consumer's ack floor and the ledger
of settled groups (`workers.ledger`). A restarted actor loads the latest, rewinds the consumer to the
floor and skips every group its ledger holds; so do copies of a group published again after a
crash, wherever they land in the stream: every group is trained exactly once in effect.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from relax_bus.bus import Bus
from relax_bus.envelope import open_message
from relax_bus.errors import BlobCorrupt, BlobNotFound, NatsUnavailable
from relax_bus.log import get_logger
from relax_bus.outage import TRANSIENT_FETCH, through_outage
from relax_bus.settle import dead_letter, term
from relax_bus.stale_filter import DROPPED_KEY, judge
from relax_bus.staleness import Verdict
from relax_bus.state_keys import TRAINER_CHECKPOINT, TRAINER_DONE, TRAINER_STEP
from schemas import Metric, RunEvent, SchemaError, TrainGroup
from workers.distributed import DrivenTrainer
from workers.ledger import RangeSet
from workers.trainer import PolicyTrainer
from workers.weights import WeightTransport

log = get_logger(__name__)

CHECKPOINT_KEY = TRAINER_CHECKPOINT
STEP_KEY = TRAINER_STEP
DONE_KEY = TRAINER_DONE
CHECKPOINT_PREFIX = "ckpt-"
ACK_OUTAGE_S = 15.0
"""How long an ack of a trained group is retried; past that, the dedupe of trained groups covers it."""


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
    """Train-stream sequence at or below which every message is settled (where a restart rewinds to)."""
    trained: RangeSet = field(default_factory=RangeSet)
    """Release indices of every group trained (see `workers.ledger`: copies can arrive at any sequence)."""
    settled: set[str] = field(default_factory=set)
    """`group_id/attempt` of every group dropped or requeued."""
    dropped: int = 0
    """Groups dropped as stale in this history; written whole to `groups.dropped` (the feeder's credit)."""

    def to_extra(self) -> dict[str, Any]:
        """Plain values for the checkpoint."""
        return {**vars(self), "trained": self.trained.ranges(), "settled": sorted(self.settled)}

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ActorState:
        return cls(
            step=int(extra["step"]),
            version=int(extra["version"]),
            floor=int(extra["floor"]),
            trained=RangeSet.from_ranges(extra.get("trained", [])),
            settled=set(extra.get("settled", [])),
            dropped=int(extra.get("dropped", 0)),
        )


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint object's name (`ckpt-<step>`); None for any other object."""
    tail = name.removeprefix(CHECKPOINT_PREFIX)
    return int(tail) if tail != name and tail.isdigit() else None


def _retain(names: list[Any], trainer: Any) -> tuple[list[str], list[str]]:
    """Split checkpoint names into (kept, pruned): step 0's and the newest `trainer.keep_checkpoints` stay."""
    by_step = {checkpoint_step(n): n for n in names if isinstance(n, str) and checkpoint_step(n) is not None}
    steps = sorted(s for s in by_step if s)
    kept = [by_step[s] for s in ([0] if 0 in by_step else []) + steps[-trainer.keep_checkpoints :]]
    return kept, [by_step[s] for s in steps[: -trainer.keep_checkpoints]]


def _holds(held: list[Held], release_index: int) -> bool:
    return any(h.group.scored.rollout.prompt.release_index == release_index for h in held)


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
        self.timings: collections.Counter[str] = collections.Counter()
        """Seconds the current step spent per phase (data wait, admitting, acks); reset with every Metric."""
        self.period_start: float | None = None  # perf_counter when the current step's period began

    # ---- setup -------------------------------------------------------------------------------------------

    async def setup(self, warmup_items: list[Any]) -> None:
        """Resume from the latest checkpoint, or warm up and publish version 0."""
        record = await self._checkpoint_record()
        current, self.revision = await through_outage(self.bus.version.get, "read policy version")
        if record is not None:
            data = await through_outage(lambda: self.bus.weights.get(record["object"]), "read checkpoint")
            extra = await asyncio.to_thread(self.trainer.restore, data)
            self.state = ActorState.from_extra(extra)
            # Versions published after that checkpoint stay taken: the next update gets a new number.
            self.state.version = max(self.state.version, current)
            await through_outage(
                lambda: self.bus.js.reset_consumer(self.stream, self.durable, seq=self.state.floor + 1),
                "rewind the train consumer",
            )
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
            entry = await through_outage(lambda: self.bus.state.get(CHECKPOINT_KEY), "read checkpoint record")
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
            await self._put(DONE_KEY, str(self.state.step))
            log.info("actor_done", step=self.state.step, version=self.state.version)
        return self.state.step

    async def _collect(self, sub: Any, stop: asyncio.Event, held: list[Held]) -> bool:
        """Fill `held` with a step's groups; False (messages handed back) when stopped first."""
        need = self.cfg.groups_per_step
        started = time.perf_counter()
        if self.period_start is None:
            self.period_start = started
        while len(held) < need:
            if stop.is_set():
                for h in held:
                    await h.msg.nak()
                return False
            try:
                msgs = await sub.fetch(need - len(held), timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except TRANSIENT_FETCH as err:
                # Tolerated: NATS is away or electing a leader (503); the next fetch works again.
                log.info("fetch_interrupted", error=type(err).__name__)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                admit_started = time.perf_counter()
                item = await self._admit(msg, held)
                self.timings["admit_s"] += time.perf_counter() - admit_started
                if item is not None:
                    held.append(item)
        self.timings["data_wait_s"] += time.perf_counter() - started
        return True

    async def _admit(self, msg: Msg, held: list[Held]) -> Held | None:
        """Decode, dedupe and judge one train message; settle it unless it joins the step."""
        seq = msg.metadata.sequence.stream
        try:
            group = await open_message(msg.data, msg.headers, self.bus.media, TrainGroup)
        except (SchemaError, BlobNotFound, BlobCorrupt) as err:
            await dead_letter(self.bus, msg, f"undecodable train message: {err}", self.durable)
            return None
        assert isinstance(group, TrainGroup)
        attempt_key = f"{group.group_id}/{group.scored.rollout.prompt.attempt}"
        index = group.scored.rollout.prompt.release_index
        if index in self.state.trained or attempt_key in self.state.settled or _holds(held, index):
            await msg.ack()  # a copy (redelivered, or published again after a crash): exactly once in effect
            return None
        decision = await judge(self.bus, group, self.state.version)
        if decision.verdict is Verdict.TRAIN:
            return Held(msg, group, seq)
        self.state.settled.add(attempt_key)
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
        ack_started = time.perf_counter()
        for h in held:
            self.state.trained.add(h.group.scored.rollout.prompt.release_index)
        # All acks in flight together: one round trip per step instead of one per group.
        await asyncio.gather(*(self._ack(h.msg) for h in held))
        self.timings["ack_s"] += time.perf_counter() - ack_started
        self.state.step += 1
        await self._put(STEP_KEY, str(self.state.step))
        await self._record_step(held, metrics, lags, weight_sync_s)
        if self.state.step % self.cfg.trainer.checkpoint_every == 0 or self.state.step == self.cfg.trainer.steps:
            await self._checkpoint()

    async def _ack(self, msg: Msg) -> None:
        try:
            await through_outage(msg.ack_sync, "ack a trained group", deadline_s=ACK_OUTAGE_S)
        except NatsUnavailable:
            pass  # tolerated: an ack lost with a server restart brings the group back; the ledger skips it

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
            **self._step_timings(),
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

    def _step_timings(self) -> dict[str, float]:
        """This step's phase seconds and `step_s`, the time since the previous step was recorded; resets both.

        data_wait_s: collecting the step's groups (waiting for data, fetch, decode, judging);
        admit_s: the decode / dedupe / staleness part of it; ack_s: acknowledging the trained groups.
        """
        now = time.perf_counter()
        phases = {"data_wait_s": 0.0, "admit_s": 0.0, "ack_s": 0.0, **self.timings}
        phases["step_s"] = now - (self.period_start if self.period_start is not None else now)
        self.timings.clear()
        self.period_start = now
        return phases

    async def _checkpoint(self) -> None:
        info = await through_outage(lambda: self.bus.js.consumer_info(self.stream, self.durable), "read ack floor")
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
        self.state.floor = floor
        extra = self.state.to_extra()
        data = await asyncio.to_thread(self.trainer.checkpoint_bytes, extra)
        name = f"{CHECKPOINT_PREFIX}{self.state.step}"
        await through_outage(lambda: self.bus.weights.put(name, data), f"put checkpoint {name}")
        old = await self._checkpoint_record()
        kept, pruned = _retain([*(old or {}).get("kept", [(old or {}).get("object")]), name], self.cfg.trainer)
        record = {"object": name, "step": self.state.step, "version": self.state.version, "floor": floor, "kept": kept}
        await self._put(CHECKPOINT_KEY, json.dumps(record))
        for gone in pruned:
            await through_outage(functools.partial(self.bus.weights.delete, gone), f"delete checkpoint {gone}")
        log.info("checkpoint_saved", **record)

    async def _put_dropped(self) -> None:
        await self._put(DROPPED_KEY, str(self.state.dropped))

    async def _put(self, key: str, value: str) -> None:
        await through_outage(lambda: self.bus.state.put(key, value.encode()), f"write {key}")

    async def _event(self, event: str, **fields: Any) -> None:
        await self.bus.publish("events", RunEvent(run=self.bus.run, event=event, source="actor", fields=fields))

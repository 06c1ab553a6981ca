"""The feeder role: releases prompt groups under the staleness credit rule.

It may have released at most `(v + max_staleness + 1) * groups_per_step + dropped` groups
(`relax_bus.staleness.release_budget`), and never more than `steps * groups_per_step + dropped`, where
`dropped` counts the groups the trainer dropped as stale, those a stage dead-lettered
(`workers.roles.dead_credit`: at most those that left the bus without being trained or dropped) and,
with `sampling.drop_uniform`, those the reward role filtered for
having all-equal rewards (`workers.roles.filtered_credit`: at most `(max_oversample - 1) x steps x
groups_per_step` of them; past that bound the run cannot finish and the feeder fails, `OversampleExhausted`,
after an `oversample_exhausted` event). It
stays until the trainer marks the run done: a group dropped late (after a trainer restart, say) must
still be replaced. Its cursor (groups released so far) lives in KV, so a restarted feeder continues
where it stopped; a group republished after a crash with the same bytes carries the same
`Nats-Msg-Id` and is deduplicated by the server (one released again at a newer policy version is a
second copy, which the actor's ledger skips). It is a source role of the bus's loop (`relax_bus.source`): `Feeder`
says what may be released now and records the cursor once a batch is stored; the bus publishes,
waits for a new policy version (or polls), heartbeats and stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from relax_bus.bus import Bus
from relax_bus.errors import CasConflict, VersionConflict
from relax_bus.log import get_logger
from relax_bus.outage import through_outage
from relax_bus.policy_version import VersionTracker
from relax_bus.source import Source
from relax_bus.staleness import releasable
from schemas import Message, PromptGroup, RunEvent
from schemas.parts import Part
from workers.config import task_seed, task_spec
from workers.data.tasks import TaskItem, epoch_order, load_task
from workers.omni.media_refs import has_media, store_inline
from workers.roles.dead_credit import DeadLetterCredit
from workers.roles.filtered_credit import (
    OversampleExhausted,
    count_below,
    exhausted,
    filtered_now,
    holds,
    oversample_cap,
)
from workers.roles.serve import RoleContext
from workers.state_keys import FEEDER_CURSOR, GROUPS_DROPPED, POLICY_VERSION, TRAINER_DONE, TRAINER_STEP

log = get_logger(__name__)

CURSOR_KEY = FEEDER_CURSOR
POLL_S = 0.2


def group_for(
    run: str, n_samples: int, items: list[TaskItem], release_index: int, version: int, seed: int | None = None
) -> PromptGroup:
    """The prompt group released as number `release_index`: epochs cycle over the dataset, each pass after
    the first in a fresh order when the task is seeded (`workers.data.tasks.epoch_order`)."""
    epoch, item = _released(items, release_index, seed)
    return PromptGroup(
        run=run,
        group_id=_group_id(epoch, item),
        parts=item.parts,
        history=item.history,
        answer=item.answer,
        n_samples=n_samples,
        release_index=release_index,
        released_at_version=version,
        epoch=epoch,
        index=item.index,
        task=item.task,
        columns=dict(item.columns),
    )


def group_id_for(items: list[TaskItem], release_index: int, seed: int | None = None) -> str:
    """The id of the group `group_for` releases as number `release_index`."""
    return _group_id(*_released(items, release_index, seed))


def released_item(items: list[TaskItem], release_index: int, seed: int | None = None) -> tuple[str, TaskItem]:
    """The group id and task item the feeder releases as number `release_index` (what a message claims to be)."""
    epoch, item = _released(items, release_index, seed)
    return _group_id(epoch, item), item


def _released(items: list[TaskItem], release_index: int, seed: int | None) -> tuple[int, TaskItem]:
    epoch, position = divmod(release_index, len(items))
    return epoch, items[epoch_order(len(items), epoch, seed)[position]]


def _group_id(epoch: int, item: TaskItem) -> str:
    return f"e{epoch}-i{item.index}"


async def serve(ctx: RoleContext) -> None:
    """`relax worker feeder`: release groups until the run is done."""
    await feed(ctx.connected, ctx.stop)


async def feed(bus: Bus, stop: asyncio.Event) -> int:
    """Release groups until the trainer is done (or `stop`); return the number released."""
    cfg = bus.config
    items = load_task(task_spec(cfg.task))
    if not items:
        raise ValueError(f"task {cfg.task.type!r} produced no items")
    released, cursor_rev = await bus.run_state.count(CURSOR_KEY)
    log.info("feeder_started", items=len(items), released=released, target=cfg.trainer.steps * cfg.groups_per_step)
    dead = await DeadLetterCredit(bus).start()
    tracker = await through_outage(VersionTracker(bus.version).start, "watch policy version")
    feeder = Feeder(bus, items, released, cursor_rev, dead, tracker)
    source = Source(bus, "feeder", feeder, poll_s=POLL_S)
    try:
        await source.run(stop=stop)
    finally:
        await tracker.stop()
        await dead.stop()
    log.info("feeder_done", released=feeder.released)
    return feeder.released


class Feeder:
    """The feeder as a source role of the bus's loop (`relax_bus.source`): what may be released now."""

    def __init__(
        self,
        bus: Bus,
        items: list[TaskItem],
        released: int,
        cursor_rev: int,
        dead: DeadLetterCredit,
        tracker: VersionTracker,
    ) -> None:
        self.bus = bus
        self.items = items
        self.seed = task_seed(bus.config.task)
        """The task's shuffle seed: each pass after the first takes a fresh order."""
        self.released = released
        """Groups released so far (the KV cursor's value)."""
        self.cursor_rev = cursor_rev
        self.dead = dead
        self.wake = tracker.changed  # a new policy version may allow more at once
        self.covered = False
        self._seen: tuple[int, int] = (0, 0)  # version and dropped count of the last batch produced
        self.filtered = 0
        """Released groups the reward role filtered (all rewards equal), as last read."""
        self._filtered_bits = b""
        """The filtered set as last read (`workers.roles.filtered_credit`): such a group earns no dead-letter credit."""
        self._stored: dict[int, tuple[Part, ...]] = {}
        """Item index -> its parts by reference, once its media is in the media store."""

    async def produce(self) -> list[PromptGroup] | None:
        cfg = self.bus.config
        target = cfg.trainer.steps * cfg.groups_per_step
        done, version, stale, steps = await _snapshot(self.bus)
        if done:
            return None
        dropped = stale  # each of these will never train: it is replaced
        if cfg.sampling.drop_uniform:
            dropped += await self._filtered_credit(target)
        filtered = dropped - stale

        async def settled() -> int:  # read again after the dead-letter credit has counted the bus
            _, _, stale_now, steps_now = await _snapshot(self.bus)
            return max(steps_now, steps) * cfg.groups_per_step + max(stale_now, stale) + filtered

        dropped += await self.dead.credit(self.released, self._group_id, self._was_filtered, settled)
        need = target + dropped - self.released
        if need <= 0 and not self.covered:
            log.info("feeder_covered", released=self.released, dropped=dropped)
        self.covered = need <= 0
        allowed = releasable(self.released, version, cfg.staleness.max_staleness, cfg.groups_per_step, dropped)
        n = max(0, min(need, cfg.groups_per_step if allowed is None else allowed, cfg.groups_per_step))
        self._seen = (version, dropped)
        n_samples, run = cfg.samples_per_group, self.bus.run
        groups = [group_for(run, n_samples, self.items, self.released + i, version, self.seed) for i in range(n)]
        return [await self._by_reference(g) for g in groups]

    async def _by_reference(self, group: PromptGroup) -> PromptGroup:
        """The group with its inline media stored once in the media store and referred to by digest
        (`workers.omni.media_refs`): every sample, epoch and role reads the one object."""
        if not has_media(group.parts):
            return group
        parts = self._stored.get(group.index)
        if parts is None:
            parts = await through_outage(lambda: store_inline(self.bus.media, group.parts), "store prompt media")
            self._stored[group.index] = parts
        return group.model_copy(update={"parts": parts})

    def _group_id(self, release_index: int) -> str:
        return group_id_for(self.items, release_index, self.seed)

    def _was_filtered(self, release_index: int) -> bool:
        return holds(self._filtered_bits, release_index)

    async def _filtered_credit(self, target: int) -> int:
        """Filtered groups to replace now: every one released so far, unless that passes the bound (then
        `OversampleExhausted`, after an `oversample_exhausted` event: the run could not finish)."""
        sampling = self.bus.config.sampling
        bitmap = await filtered_now(self.bus.run_state)
        self._filtered_bits = bitmap
        self.filtered = count_below(bitmap, self.released)
        cap = oversample_cap(sampling.max_oversample, target)
        if exhausted(self.filtered, cap):
            why = (
                f"{self.filtered} groups filtered (all rewards equal) of {self.released} released, more than the "
                f"{cap} that sampling.max_oversample {sampling.max_oversample:g} lets the feeder replace for "
                f"{target} trained groups: the run cannot finish; raise max_oversample or make the reward vary"
            )
            log.error("oversample_exhausted", filtered=self.filtered, cap=cap, released=self.released)
            await self._event("oversample_exhausted", "error", filtered=self.filtered, cap=cap, released=self.released)
            raise OversampleExhausted(why)
        return self.filtered

    async def published(self, batch: Sequence[Message]) -> None:
        new = self.released + len(batch)
        self.cursor_rev = await _advance_cursor(self.bus, self.released, new, self.cursor_rev)
        self.released = new
        version, dropped = self._seen
        log.info("groups_released", released=self.released, version=version, dropped=dropped, filtered=self.filtered)
        if self.bus.config.sampling.drop_uniform:
            await self._event(
                "sampling_progress",
                "info",
                released=self.released,
                filtered=self.filtered,
                filtered_fraction=round(self.filtered / self.released, 6),
            )

    async def _event(self, event: str, level: str, **fields: int | float) -> None:
        message = RunEvent(run=self.bus.run, event=event, level=level, source="feeder", fields=dict(fields))
        try:
            await self.bus.publish("events", message)
        except Exception as err:  # tolerated: events are informative; the KV state holds the truth
            log.warning("event_lost", name=event, error=str(err))


async def _snapshot(bus: Bus) -> tuple[bool, int, int, int]:
    """`(trainer done, policy version, groups dropped, trainer steps)`."""
    state = bus.run_state
    done = await state.get(TRAINER_DONE) is not None
    version, _ = await state.count(POLICY_VERSION)
    dropped, _ = await state.count(GROUPS_DROPPED)
    steps, _ = await state.count(TRAINER_STEP)
    return done, version, dropped, steps


async def _advance_cursor(bus: Bus, old: int, new: int, revision: int) -> int:
    """Compare-and-set the cursor from `old` to `new`; return its new revision.

    A second feeder of the same run (a mistake) fails here instead of double-releasing. When NATS
    drops the answer, the cursor is read back: a write that landed is recognised by its value (`KvCounter.cas`).
    """
    try:
        return await bus.run_state.cas(CURSOR_KEY, new, revision)
    except CasConflict as err:
        now = "" if err.current is None else f" -> {err.current}"
        raise VersionConflict(f"feeder cursor moved under this feeder ({old}{now}): a second feeder?") from None

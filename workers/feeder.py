"""The feeder role: releases prompt groups under the staleness credit rule.

It may have released at most `(v + max_staleness + 1) * groups_per_step + dropped` groups
(`relax_bus.staleness.release_budget`), and never more than `steps * groups_per_step + dropped`, where
`dropped` counts the groups the trainer dropped as stale and those a stage dead-lettered
(`workers.dead_credit`). It
stays until the trainer marks the run done: a group dropped late (after a trainer restart, say) must
still be replaced. Its cursor (groups released so far) lives in KV, so a restarted feeder continues
where it stopped; a group republished after a crash carries the same `Nats-Msg-Id` and is
deduplicated by the server.
"""

from __future__ import annotations

import asyncio

from relax_bus.bus import Bus
from relax_bus.errors import PublishFailed, VersionConflict
from relax_bus.log import get_logger
from relax_bus.outage import is_transient, through_outage
from relax_bus.stale_filter import read_counter
from relax_bus.staleness import releasable
from relax_bus.state_keys import FEEDER_CURSOR, GROUPS_DROPPED, TRAINER_DONE
from relax_bus.version import VersionTracker
from schemas import PromptGroup
from workers.dead_credit import DeadLetterCredit
from workers.tasks import TaskItem, load_task

log = get_logger(__name__)

CURSOR_KEY = FEEDER_CURSOR
POLL_S = 0.2


def group_for(run: str, n_samples: int, items: list[TaskItem], release_index: int, version: int) -> PromptGroup:
    """The prompt group released as number `release_index` (epochs cycle over the dataset)."""
    epoch, row = divmod(release_index, len(items))
    item = items[row]
    return PromptGroup(
        run=run,
        group_id=f"e{epoch}-i{item.index}",
        parts=item.parts,
        answer=item.answer,
        n_samples=n_samples,
        release_index=release_index,
        released_at_version=version,
        epoch=epoch,
        index=item.index,
        task=item.task,
    )


async def feed(bus: Bus, stop: asyncio.Event) -> int:
    """Release groups until the trainer is done (or `stop`); return the number released."""
    cfg = bus.config
    items = load_task({"type": cfg.task.type, **cfg.task.options})
    if not items:
        raise ValueError(f"task {cfg.task.type!r} produced no items")
    released, cursor_rev = await through_outage(lambda: read_counter(bus.state, CURSOR_KEY), "read feeder cursor")
    target = cfg.trainer.steps * cfg.groups_per_step
    log.info("feeder_started", items=len(items), released=released, target=target)
    dead = await DeadLetterCredit(bus).start()
    tracker = await through_outage(VersionTracker(bus.version).start, "watch policy version")
    try:
        return await _release(bus, stop, items, released, cursor_rev, dead, tracker)
    finally:
        await tracker.stop()
        await dead.stop()


async def _release(
    bus: Bus,
    stop: asyncio.Event,
    items: list[TaskItem],
    released: int,
    cursor_rev: int,
    dead: DeadLetterCredit,
    tracker: VersionTracker,
) -> int:
    cfg = bus.config
    target = cfg.trainer.steps * cfg.groups_per_step
    covered = False
    while not stop.is_set():
        done, version, stale = await through_outage(lambda: _snapshot(bus), "read run state")
        if done:
            break
        dropped = stale + len(dead)  # groups that will never train: each is replaced
        need = target + dropped - released
        if need <= 0 and not covered:
            log.info("feeder_covered", released=released, dropped=dropped)
        covered = need <= 0
        allowed = releasable(released, version, cfg.staleness.max_staleness, cfg.groups_per_step, dropped)
        n = max(0, min(need, cfg.groups_per_step if allowed is None else allowed, cfg.groups_per_step))
        if n == 0:
            await _wait(stop, tracker.changed, POLL_S)  # a new policy version wakes it at once
            continue
        subject = bus.topology.subject("prompts")
        groups = [group_for(bus.run, cfg.samples_per_group, items, released + i, version) for i in range(n)]
        try:
            await bus.publisher.publish_many([(subject, g) for g in groups], deadline_s=30.0)
        except PublishFailed as err:
            # Tolerated: the prompts hop is full (back-pressure) or NATS is away; retry the same ids.
            log.info("feeder_waiting", reason=str(err))
            continue
        cursor_rev = await _advance_cursor(bus, released, released + n, cursor_rev)
        released += n
        log.info("groups_released", released=released, version=version, dropped=dropped)
    log.info("feeder_done", released=released)
    return released


async def _snapshot(bus: Bus) -> tuple[bool, int, int]:
    """`(trainer done, policy version, groups dropped)`."""
    done = (await read_counter(bus.state, TRAINER_DONE))[1] > 0
    version, _ = await bus.version.get()
    dropped, _ = await read_counter(bus.state, GROUPS_DROPPED)
    return done, version, dropped


async def _advance_cursor(bus: Bus, old: int, new: int, revision: int) -> int:
    """Compare-and-set the cursor from `old` to `new`; return its new revision.

    A second feeder of the same run (a mistake) fails here instead of double-releasing. When NATS
    drops the answer, the cursor is read back: a write that landed is recognised by its value.
    """
    value = str(new).encode()
    while True:
        try:
            if revision:
                return int(await bus.state.update(CURSOR_KEY, value, last=revision))
            return int(await bus.state.create(CURSOR_KEY, value))
        except Exception as err:
            if not is_transient(err):
                raise
        await asyncio.sleep(0.2)
        current, now = await through_outage(lambda: read_counter(bus.state, CURSOR_KEY), "read feeder cursor")
        if current == new and now != revision:
            return now
        if now != revision or current != old:
            raise VersionConflict(f"feeder cursor moved under this feeder ({old} -> {current}): a second feeder?")


async def _wait(stop: asyncio.Event, changed: asyncio.Event, seconds: float) -> None:
    """Until `stop` or `changed` is set, or `seconds` pass."""
    changed.clear()
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(changed.wait())]
    await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()

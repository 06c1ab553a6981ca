"""The consumer-side staleness filter, as middleware for roles that consume train groups.

It applies `staleness.decide` against the trainer's current policy version, to the group's oldest token's
version (its `policy_version`), or with `staleness.mask_stale_tokens` to its newest. A stale group is
dropped (`Drop`, reason recorded, the feeder gets the credit back through the dropped-groups counter)
or, with `action: requeue`, its prompt is republished as the next attempt and the train message is
acked (`Skip`). Fresh groups pass. Two forms: `admit_fresh`, the admission step of a batch role (the
actor, `relax_bus.batch_worker`), and `stale_filter`, a wrapper around a per-message handler.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import nats.js.errors
from nats.js.kv import KeyValue

from relax_bus.bus import Bus
from relax_bus.control import Drop, Skip
from relax_bus.delivery import Delivery, Handler, HandlerResult
from relax_bus.errors import VersionConflict
from relax_bus.staleness import Decision, Verdict, decide
from relax_bus.state_keys import GROUPS_DROPPED
from schemas import RunEvent, TrainGroup

DROPPED_KEY = GROUPS_DROPPED


async def read_counter(kv: KeyValue, key: str) -> tuple[int, int]:
    """`(value, revision)` of an integer KV counter; `(0, 0)` when unset."""
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return 0, 0
    return int(entry.value or b"0"), int(entry.revision or 0)


async def add_to_counter(kv: KeyValue, key: str, n: int, attempts: int = 50) -> int:
    """Add `n` to an integer KV counter with compare-and-set (safe with many writers); return the new value."""
    for _ in range(attempts):
        value, revision = await read_counter(kv, key)
        new = str(value + n).encode()
        try:
            if revision == 0:
                await kv.create(key, new)
            else:
                await kv.update(key, new, last=revision)
            return value + n
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
            continue
        except nats.js.errors.APIError as err:
            if err.err_code == 10071:  # create raced with another writer
                continue
            raise
    raise VersionConflict(f"counter {key} kept changing under {attempts} compare-and-set attempts")


async def judge(bus: Bus, group: TrainGroup, version: int) -> Decision:
    """Apply the run's staleness rule to a group at trainer version `version`, with its side effects.

    A requeued group's prompt is republished as the next attempt (and a `group_requeued` event
    recorded). Counting a drop is the caller's part: the middleware below adds to the run's counter,
    the actor keeps the count in its checkpointed state so that a drop replayed after a restart is
    not counted twice.
    """
    rule = bus.config.staleness
    rollout = group.scored.rollout
    prompt = rollout.prompt
    # By its oldest token; with mask_stale_tokens by its newest, the older tokens masked by the trainer.
    sample_version = rollout.newest_version if rule.mask_stale_tokens else group.policy_version
    d = decide(version, sample_version, rule.max_staleness, rule.action, prompt.attempt, rule.max_requeues)
    if d.verdict is Verdict.REQUEUE:
        again = prompt.model_copy(update={"attempt": prompt.attempt + 1, "released_at_version": version})
        await bus.publish("prompts", again)
        event = RunEvent(
            run=bus.run,
            event="group_requeued",
            source="stale_filter",
            fields={"group_id": prompt.group_id, "lag": d.lag, "reason": d.reason},
        )
        await bus.publish("events", event)
    return d


OnDecision = Callable[[Decision], Awaitable[None]]


async def admit_fresh(bus: Bus, group: TrainGroup, version: int, on_requeue: OnDecision, on_drop: OnDecision) -> None:
    """Return when `group` is fresh enough at trainer version `version`; otherwise raise `Skip` once its
    prompt is requeued, or `Drop(reason)`, each after the caller's bookkeeping (`on_requeue`, `on_drop`)."""
    d = await judge(bus, group, version)
    if d.verdict is Verdict.TRAIN:
        return
    if d.verdict is Verdict.REQUEUE:
        await on_requeue(d)
        raise Skip()
    await on_drop(d)
    raise Drop(d.reason)


def stale_filter(bus: Bus, trainer_version: Callable[[], int]) -> Callable[[Handler[TrainGroup]], Handler[TrainGroup]]:
    """Middleware: wrap a train-group handler with the run's staleness rule (drops counted in the shared
    counter, which returns each dropped group's credit to the feeder)."""

    async def nothing(decision: Decision) -> None:
        return None

    async def count_drop(decision: Decision) -> None:
        await add_to_counter(bus.state, DROPPED_KEY, 1)

    def wrap(handler: Handler[TrainGroup]) -> Handler[TrainGroup]:
        async def filtered(group: TrainGroup, delivery: Delivery) -> HandlerResult:
            await admit_fresh(bus, group, trainer_version(), nothing, count_drop)
            return await handler(group, delivery)

        return filtered

    return wrap

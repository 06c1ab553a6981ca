"""The trainer-side staleness rule: which train groups the actor may still train.

It applies `relax_bus.staleness.decide` against the trainer's current policy version, to the group's oldest
token's version (its `policy_version`), or with `staleness.mask_stale_tokens` to its newest. A stale group is
dropped (`Drop`, reason recorded, the feeder gets the credit back through the run's `groups.dropped`) or, with
`action: requeue`, its prompt is republished as the next attempt and the train message is acked (`Skip`).
Fresh groups pass. `admit_fresh` is the admission step of the actor (a batch role, `relax_bus.batch_worker`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from relax_bus.bus import Bus
from relax_bus.control import Drop, Skip
from relax_bus.staleness import Decision, Verdict, decide
from schemas import RunEvent, TrainGroup


async def judge(bus: Bus, group: TrainGroup, version: int) -> Decision:
    """Apply the run's staleness rule to a group at trainer version `version`, with its side effects.

    A requeued group's prompt is republished as the next attempt (and a `group_requeued` event
    recorded). Counting a drop is the caller's part: the actor keeps the count in its checkpointed state,
    so that a drop replayed after a restart is not counted twice.
    """
    rule = bus.config.staleness
    rollout = group.scored.rollout
    prompt = group.prompt
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

"""Where the actor's checkpoints live on the bus: the KV record that names the newest complete one, and storing
a new one (object first, record after, older ones pruned), so a crash mid-upload leaves the previous record."""

from __future__ import annotations

import functools
import json
from typing import Any

import nats.js.errors

from relax_bus.bus import Bus
from relax_bus.outage import through_outage
from relax_bus.state_keys import TRAINER_CHECKPOINT
from workers.roles.actor_state import CHECKPOINT_PREFIX, retain_checkpoints


async def checkpoint_record(bus: Bus) -> dict[str, Any] | None:
    """The record of the newest complete checkpoint, or None before the first."""
    try:
        entry = await through_outage(lambda: bus.state.get(TRAINER_CHECKPOINT), "read checkpoint record")
    except nats.js.errors.KeyNotFoundError:
        return None
    return json.loads(entry.value or b"{}") or None


async def store_checkpoint(bus: Bus, data: bytes, step: int, version: int, floor: int) -> dict[str, Any]:
    """Upload checkpoint bytes, then point the record at them and prune past `trainer.keep_checkpoints`."""
    name = f"{CHECKPOINT_PREFIX}{step}"
    await through_outage(lambda: bus.weights.put(name, data), f"put checkpoint {name}")
    old = await checkpoint_record(bus) or {}
    kept, pruned = retain_checkpoints([*old.get("kept", [old.get("object")]), name], bus.config.trainer)
    record = {"object": name, "step": step, "version": version, "floor": floor, "kept": kept}
    await through_outage(
        lambda: bus.state.put(TRAINER_CHECKPOINT, json.dumps(record).encode()), f"write {TRAINER_CHECKPOINT}"
    )
    for gone in pruned:
        await through_outage(functools.partial(bus.weights.delete, gone), f"delete checkpoint {gone}")
    return record

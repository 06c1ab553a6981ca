"""Where the actor's checkpoints live: the KV record that names the newest complete one, and storing a new one
(data first, record after, older ones pruned), so a crash mid-save leaves the previous record.

A checkpoint is either one object in the checkpoints store (`ckpt-<step>`, the whole state gathered on rank 0)
or, with `trainer.checkpoint.dir`, a directory `<checkpoint_dir>/<run>/ckpt-<step>` of every rank's shards
(`workers.checkpoints.sharded`); the record says which (`object` or `dir`)."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from relax_bus.bus import Bus
from relax_bus.log import get_logger
from relax_bus.outage import through_outage
from workers.roles.actor_state import CHECKPOINT_PREFIX, checkpoint_step, retain_checkpoints
from workers.state_keys import TRAINER_CHECKPOINT

log = get_logger(__name__)


async def checkpoint_record(bus: Bus) -> dict[str, Any] | None:
    """The record of the newest complete checkpoint, or None before the first."""
    value = await bus.run_state.get(TRAINER_CHECKPOINT)
    if value is None:
        return None
    return json.loads(value or b"{}") or None


async def kept_checkpoints(bus: Bus) -> dict[int, dict[str, str]]:
    """Every checkpoint the run keeps, by step: `{"object": name}` in the checkpoints store, `{"dir": path}` of
    shards."""
    kept = {step: {"object": n} for n in await bus.checkpoints.names() if (step := checkpoint_step(n)) is not None}
    record = await checkpoint_record(bus)
    if record is not None and "dir" in record:
        root = Path(record["dir"]).parent
        for name in record.get("kept", []):
            step = checkpoint_step(name)
            if step is not None and (root / name).is_dir():
                kept[step] = {"dir": str(root / name)}
    return dict(sorted(kept.items()))


def sharded_root(bus: Bus) -> Path | None:
    """The directory of this run's sharded checkpoints; None when they go to the object store."""
    root = bus.config.trainer.checkpoint.dir
    return None if root is None else Path(root) / bus.run


def sharded_path(bus: Bus, step: int) -> Path:
    root = sharded_root(bus)
    assert root is not None, "trainer.checkpoint.dir is not set"
    return root / f"{CHECKPOINT_PREFIX}{step}"


async def store_checkpoint(bus: Bus, data: bytes, step: int, version: int, floor: int) -> dict[str, Any]:
    """Upload checkpoint bytes, then point the record at them and prune past `trainer.checkpoint.keep`."""
    name = f"{CHECKPOINT_PREFIX}{step}"
    await through_outage(lambda: bus.checkpoints.put(name, data), f"put checkpoint {name}")
    return await _record(bus, {"object": name}, name, step, version, floor)


async def record_sharded(bus: Bus, step: int, version: int, floor: int) -> dict[str, Any]:
    """Point the record at the sharded checkpoint of `step` (every rank's shards written), then prune."""
    name = f"{CHECKPOINT_PREFIX}{step}"
    return await _record(bus, {"dir": str(sharded_path(bus, step))}, name, step, version, floor)


async def _record(bus: Bus, where: dict[str, str], name: str, step: int, version: int, floor: int) -> dict[str, Any]:
    old = await checkpoint_record(bus) or {}
    kept, pruned = retain_checkpoints([*old.get("kept", [old.get("object")]), name], bus.config.trainer)
    record = {**where, "step": step, "version": version, "floor": floor, "kept": kept}
    await bus.run_state.put(TRAINER_CHECKPOINT, json.dumps(record).encode())
    root = sharded_root(bus)
    for gone in pruned:
        if root is not None:
            await asyncio.to_thread(shutil.rmtree, root / gone, True)
            continue
        await through_outage(functools.partial(bus.checkpoints.delete, gone), f"delete checkpoint {gone}")
    return record


def clear_cut_off_dirs(bus: Bus, record: dict[str, Any] | None) -> list[str]:
    """Remove the run's checkpoint directories that no record names (a save cut off by a crash); their names."""
    root = sharded_root(bus)
    if root is None or not root.is_dir():
        return []
    named = set((record or {}).get("kept", []))
    cut = sorted(p.name for p in root.iterdir() if p.name.startswith(CHECKPOINT_PREFIX) and p.name not in named)
    for name in cut:
        shutil.rmtree(root / name, ignore_errors=True)
    return cut


class ActorCheckpoints:
    """The actor's checkpoints: staged at the step, written and recorded in the background, one at a time. The
    KV record names a checkpoint only once it is whole, so a crash mid-save resumes from the previous one."""

    def __init__(self, bus: Bus, checkpoints: Any) -> None:
        self.bus = bus
        self.checkpoints = checkpoints
        """The trainer's checkpoints (`workers.checkpoints.trainer_state.TrainerCheckpoints`, mirrored on every rank
        under torchrun)."""
        self.saving: asyncio.Task[None] | None = None
        """The save in progress."""
        self.path_s: float | None = None
        """Seconds the last checkpoint held the step up (its snapshot, or staging every rank's shards)."""
        self.save_s: float | None = None
        """Seconds the last background save took (serialise, upload or write, record)."""

    async def start(self, extra: dict[str, Any], step: int, version: int, floor: int) -> None:
        """Snapshot now, then save and record in the background (after the save in progress, if any)."""
        await self.wait()
        started = time.perf_counter()
        save: Coroutine[Any, Any, dict[str, Any]]
        if sharded_root(self.bus) is not None:  # every rank stages its shards, then writes them in a thread
            path = str(sharded_path(self.bus, step))
            written = await asyncio.to_thread(self.checkpoints.save_sharded, path, extra)
            save = self._record_sharded(written, step, version, floor)
        else:
            state = await asyncio.to_thread(self.checkpoints.state, extra)
            save = self._upload(state, step, version, floor)
        self.path_s = time.perf_counter() - started
        self.saving = asyncio.create_task(self._timed(save), name="save-checkpoint")

    async def wait(self) -> None:
        """Wait for the save in progress, if any (its failure is raised here)."""
        if self.saving is not None:
            task, self.saving = self.saving, None
            await task

    async def restore(self, record: dict[str, Any]) -> dict[str, Any]:
        """Load the recorded checkpoint (a directory of shards, or one object of the checkpoints store); its extra."""
        if "dir" in record:
            return await asyncio.to_thread(self.checkpoints.restore_sharded, record["dir"])
        data = await through_outage(lambda: self.bus.checkpoints.get(record["object"]), "read checkpoint")
        return await asyncio.to_thread(self.checkpoints.restore, data)

    async def _timed(self, save: Coroutine[Any, Any, dict[str, Any]]) -> None:
        started = time.perf_counter()
        record = await save
        self.save_s = time.perf_counter() - started
        log.info("checkpoint_saved", seconds=round(self.save_s, 3), **record)

    async def _upload(self, state: dict[str, Any], step: int, version: int, floor: int) -> dict[str, Any]:
        data = await asyncio.to_thread(self.checkpoints.serialize, state)
        del state
        return await store_checkpoint(self.bus, data, step, version, floor)

    async def _record_sharded(self, written: Future[Any], step: int, version: int, floor: int) -> dict[str, Any]:
        await asyncio.wrap_future(written)
        return await record_sharded(self.bus, step, version, floor)

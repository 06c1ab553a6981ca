"""Worker liveness: every worker rewrites its own heartbeat in a TTL bucket.

A worker that stops writing (crashed, hung, partitioned) disappears when its entry ages out; no
controller clock is involved. Keys are `<role>.<worker_id>`.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Callable

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from relax_bus.log import get_logger
from schemas import WorkerHeartbeat, decode, encode

log = get_logger(__name__)


def process_heartbeat(
    run: str,
    role: str,
    worker_id: str,
    started_at: float,
    policy_version: int | None = None,
    counters: dict[str, int] | None = None,
) -> WorkerHeartbeat:
    """The heartbeat of this process (its pid and host filled in)."""
    return WorkerHeartbeat(
        run=run,
        role=role,
        worker_id=worker_id,
        pid=os.getpid(),
        host=socket.gethostname(),
        policy_version=policy_version,
        counters=counters or {},
        started_at=started_at,
    )


class HeartbeatWriter:
    """Background task that writes `make()` to the workers bucket every `interval_s` seconds."""

    def __init__(self, kv: KeyValue, key: str, make: Callable[[], WorkerHeartbeat], interval_s: float) -> None:
        self.kv = kv
        self.key = key
        self.make = make
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def beat(self) -> None:
        await self.kv.put(self.key, encode(self.make()))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"heartbeat:{self.key}")

    async def _loop(self) -> None:
        while True:
            try:
                await self.beat()
            except (nats.errors.Error, OSError) as err:
                # Tolerated: a missed beat while NATS is away; the next one catches up.
                log.debug("heartbeat_missed", key=self.key, error=type(err).__name__)
            await asyncio.sleep(self.interval_s)

    async def stop(self, remove: bool = True) -> None:
        """Stop beating; with `remove`, delete the entry so the worker vanishes at once."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if remove:
            try:
                await self.kv.delete(self.key)
            except (nats.errors.Error, OSError):
                pass  # tolerated: the TTL removes it anyway


async def live_workers(kv: KeyValue) -> list[WorkerHeartbeat]:
    """Heartbeats of every worker whose entry has not expired, sorted by role then id."""
    try:
        keys = await kv.keys()
    except nats.js.errors.NoKeysError:
        return []
    beats = []
    for key in keys:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue  # expired between keys() and get()
        if entry.value:
            try:
                beats.append(decode(entry.value, WorkerHeartbeat))
            except Exception:  # tolerated: a foreign or old entry in the bucket is not a worker
                log.debug(
                    "heartbeat_unreadable",
                    key=key,
                    value=json.dumps(entry.value[:60].decode(errors="replace")),
                )
    return sorted(beats, key=lambda b: (b.role, b.worker_id))

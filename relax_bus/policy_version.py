"""The policy version in KV: compare-and-set writes and a watcher that survives reconnects.

Policy version `v` is the number of optimizer updates the trainer has published. Only the trainer
writes it, and only forward: `advance` is a compare-and-set on the KV revision it last read, so a
second (zombie) trainer cannot move the version under a live one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from relax_bus.cancel import cancel_and_wait
from relax_bus.errors import CasConflict, VersionConflict
from relax_bus.kv_counter import KvCounter
from relax_bus.log import get_logger
from relax_bus.outage import is_transient, through_outage
from relax_bus.staleness import POLICY_VERSION

log = get_logger(__name__)

KEY = POLICY_VERSION


class PolicyVersion:
    """Reads, advances and watches `policy.version` in the run's state bucket."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv
        self.counter = KvCounter(kv, KEY)

    async def get(self) -> tuple[int, int]:
        """`(version, revision)`; `(0, 0)` before the first update."""
        return await self.counter.get()

    async def advance(self, version: int, expected_revision: int) -> int:
        """Set the version if the key is still at `expected_revision` (0: never written); return the new revision.

        Raises VersionConflict if another writer moved it, or if `version` would not move it forward.
        Rides through a NATS outage: when the answer to the write is lost, the key is read back, and a
        write that landed is recognised by its value instead of being mistaken for another writer's
        (`KvCounter.cas`).
        """
        current, revision = await through_outage(self.get, "read policy version")
        if revision != expected_revision:
            raise VersionConflict(
                f"policy version was changed by another writer (revision {revision}, expected {expected_revision})"
            )
        if version <= current and revision != 0:
            raise VersionConflict(f"policy version may only grow: {current} -> {version} refused")
        try:
            return await self.counter.cas(version, expected_revision)
        except CasConflict:
            raise VersionConflict(f"policy version was changed by another writer while setting {version}") from None

    async def watch(self, poll_s: float = 2.0) -> AsyncIterator[int]:
        """Yield each new version, in increasing order, for as long as the caller iterates.

        Survives reconnects and server restarts: the push watcher is recreated whenever it breaks,
        and a `get()` every `poll_s` seconds catches any update a broken watcher missed.
        """
        last = -1
        while True:
            watcher = None
            try:
                watcher = await self.kv.watch(KEY)
                while True:
                    try:
                        entry = await watcher.updates(timeout=poll_s)  # type: ignore[no-untyped-call]
                    except (nats.errors.TimeoutError, TimeoutError):
                        entry = None
                    missed = False
                    if entry is not None and entry.value:
                        value = int(entry.value)
                    else:
                        value, revision = await self.get()
                        if revision == 0:
                            continue  # nothing published yet
                        # An update the push watcher never delivered: it went deaf (a server restart).
                        missed = value > last >= 0
                    if value > last:
                        last = value
                        yield value
                    if missed:
                        log.info("version_watch_rebuild", error="missed an update")
                        break
            except (nats.errors.Error, OSError) as err:
                # Tolerated: the connection is down or the watcher's consumer is gone; rebuild it.
                log.info("version_watch_rebuild", error=type(err).__name__)
                await asyncio.sleep(0.5)
            finally:
                if watcher is not None:
                    try:
                        await watcher.stop()  # type: ignore[no-untyped-call]
                    except Exception:  # the subscription may already be gone with its connection
                        pass


class VersionTracker:
    """Keeps the latest policy version in memory from a background watcher.

    `value` is -1 until the trainer has published version 0; `changed` is set on every new version.
    """

    def __init__(self, version: PolicyVersion, poll_s: float = 1.0) -> None:
        self.version = version
        self.poll_s = poll_s
        self.value = -1
        self.changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> VersionTracker:
        """Read the current version, then follow updates in the background."""
        value, revision = await self.version.get()
        self.value = value if revision else -1
        self._task = asyncio.create_task(self._follow(), name="version-tracker")
        return self

    async def _follow(self) -> None:
        async for value in self.version.watch(poll_s=self.poll_s):
            self._observe(value)

    def _observe(self, value: int) -> None:
        if value > self.value:
            self.value = value
            self.changed.set()

    async def refresh(self, timeout_s: float = 2.0) -> int:
        """Read the version now (a watcher can lag a reconnect); keep the watched value if NATS is away."""
        try:
            value, revision = await asyncio.wait_for(self.version.get(), timeout_s)
        except Exception as err:
            if not is_transient(err):
                raise
            return self.value  # tolerated: the watcher (or the next refresh) catches up
        if revision:
            self._observe(value)
        return self.value

    async def wait_for(self, minimum: int) -> int:
        """Wait until the version is at least `minimum`; return it.

        Does not rely on the watcher alone: every `poll_s` without news it reads the version itself,
        and a watcher task that died raises its error here instead of leaving the caller waiting.
        """
        while self.value < minimum:
            if self._task is not None and self._task.done() and not self._task.cancelled():
                self._task.result()  # re-raises what stopped the watcher
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), self.poll_s)
            except TimeoutError:
                await self.refresh()
        return self.value

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

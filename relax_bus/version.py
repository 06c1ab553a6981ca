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

from relax_bus.errors import VersionConflict
from relax_bus.log import get_logger
from relax_bus.state_keys import POLICY_VERSION

log = get_logger(__name__)

KEY = POLICY_VERSION


class PolicyVersion:
    """Reads, advances and watches `policy.version` in the run's state bucket."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def get(self) -> tuple[int, int]:
        """`(version, revision)`; `(0, 0)` before the first update."""
        try:
            entry = await self.kv.get(KEY)
        except nats.js.errors.KeyNotFoundError:
            return 0, 0
        return int(entry.value or b"0"), int(entry.revision or 0)

    async def advance(self, version: int, expected_revision: int) -> int:
        """Set the version if the key is still at `expected_revision` (0: never written); return the new revision.

        Raises VersionConflict if another writer moved it, or if `version` would not move it forward.
        """
        current, revision = await self.get()
        if revision != expected_revision:
            raise VersionConflict(
                f"policy version was changed by another writer (revision {revision}, expected {expected_revision})"
            )
        if version <= current and revision != 0:
            raise VersionConflict(f"policy version may only grow: {current} -> {version} refused")
        value = str(version).encode()
        try:
            if expected_revision == 0:
                return int(await self.kv.create(KEY, value))
            return int(await self.kv.update(KEY, value, last=expected_revision))
        except nats.js.errors.KeyWrongLastSequenceError:
            raise VersionConflict(f"policy version was changed by another writer while setting {version}") from None
        except nats.js.errors.APIError as err:
            if err.err_code == 10071:  # wrong last sequence (create on an existing key)
                raise VersionConflict(f"policy version was set by another writer while setting {version}") from None
            raise

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
                    if entry is not None and entry.value:
                        value = int(entry.value)
                    else:
                        value, revision = await self.get()
                        if revision == 0:
                            continue  # nothing published yet
                    if value > last:
                        last = value
                        yield value
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
            if value > self.value:
                self.value = value
                self.changed.set()

    async def wait_for(self, minimum: int) -> int:
        """Wait until the version is at least `minimum`; return it."""
        while self.value < minimum:
            self.changed.clear()
            if self.value >= minimum:
                break
            await self.changed.wait()
        return self.value

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

"""The policy version in KV: compare-and-set writes and a watcher that survives reconnects.

Policy version `v` is the number of optimizer updates the trainer has published. Only the trainer
writes it, and only forward: `advance` is a compare-and-set on the KV revision it last read, so a
second (zombie) trainer cannot move the version under a live one.
"""

from __future__ import annotations

import asyncio
import contextlib
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

        Each write of the key is also published on its subject: a plain core-NATS subscription to it (not a
        JetStream consumer: roles create none, `relax_bus.direct_get`) wakes the watcher, which then reads the
        key itself, so what it yields is always the stored value, whoever published on the subject. A read
        every `poll_s` seconds catches what the subscription misses (it is at most once, and deaf while the
        connection is away); the subscription is made again after a connection error.
        """
        last = -1
        subject = f"{self.kv._pre}{KEY}"  # nats-py keeps the bucket's subject prefix only here
        woken = asyncio.Event()

        async def wake(_: object) -> None:
            woken.set()

        while True:
            sub = None
            try:
                sub = await self.kv._js._nc.subscribe(subject, cb=wake)
                while True:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(woken.wait(), poll_s)
                    woken.clear()
                    value, revision = await self.get()
                    if revision and value > last:
                        last = value
                        yield value
            except (nats.errors.Error, OSError) as err:
                if not is_transient(err) and not isinstance(err, nats.errors.ConnectionClosedError):
                    raise
                # Tolerated: the connection is down; read and subscribe again.
                log.info("version_watch_rebuild", error=type(err).__name__)
                await asyncio.sleep(0.5)
            finally:
                if sub is not None:
                    with contextlib.suppress(Exception):  # the subscription may be gone with its connection
                        await sub.unsubscribe()


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

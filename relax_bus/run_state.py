"""`RunState`: the run's state bucket, read and written through NATS outages.

A role reads and writes a few keys of the run's state bucket (`relax_<run>_state`): a record, a counter,
an address. Each method here rides through a server restart or a leader election itself
(`relax_bus.outage`), so a role never wraps a KV call in a retry of its own. `get` and `put` are idempotent
and simply retried; `cas` is a compare-and-set, which resolves a lost answer by reading back
(`relax_bus.kv_counter.KvCounter.cas`). `Bus.state` stays the bucket itself, for what needs the raw handle
(the policy version's watcher, a compare-and-set of a value that is not a counter).
"""

from __future__ import annotations

import nats.js.errors
from nats.js.kv import KeyValue

from relax_bus.kv_counter import KvCounter
from relax_bus.outage import through_outage


class RunState:
    """The run's state bucket, each call riding through a NATS outage."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def get(self, key: str) -> bytes | None:
        """The value of `key`; None when it was never written (or was deleted)."""
        try:
            entry = await through_outage(lambda: self.kv.get(key), f"read {key}")
        except nats.js.errors.KeyNotFoundError:
            return None
        return bytes(entry.value or b"")

    async def put(self, key: str, value: bytes) -> int:
        """Write `value` under `key` (last writer wins); return its revision."""
        return int(await through_outage(lambda: self.kv.put(key, value), f"write {key}"))

    def counter(self, key: str) -> KvCounter:
        """The integer counter under `key`."""
        return KvCounter(self.kv, key)

    async def count(self, key: str) -> tuple[int, int]:
        """`(value, revision)` of the integer counter under `key`; `(0, 0)` when unset."""
        return await through_outage(self.counter(key).get, f"read {key}")

    async def cas(self, key: str, value: int, expected_revision: int) -> int:
        """Set the integer counter under `key` to `value` if it is still at `expected_revision` (0: never written);
        return the new revision. Raises CasConflict when another writer moved it."""
        return await self.counter(key).cas(value, expected_revision)

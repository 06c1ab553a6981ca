"""An integer in a KV bucket, written with compare-and-set.

The value is the integer's decimal text (`nats kv get` shows it); an unset key reads as `(0, 0)`, value
and revision. Three writes:

- `cas(value, expected_revision)`: set the value if the key is still at the revision the writer last
  read (0: never written), so that a second writer (a zombie trainer, a second feeder) cannot move it
  under a live one. Rides through a NATS outage: a write whose answer was lost may have landed, so the
  key is read back, and a write that landed is recognised by its value instead of being mistaken for
  another writer's (`CasConflict` only when someone else moved it).
- `add(n)`: read, then compare-and-set `value + n`, again on a conflict: safe with many writers.
- `get()`: `(value, revision)`.
"""

from __future__ import annotations

import asyncio
import time

import nats.js.errors
from nats.js.kv import KeyValue

from relax_bus.errors import CasConflict, NatsUnavailable
from relax_bus.log import get_logger
from relax_bus.outage import OUTAGE_S, TRANSIENT, is_transient, raise_if_denied, through_outage

log = get_logger(__name__)

WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code for a create on a key that exists (a write that lost the race)."""


class KvCounter:
    """One integer key of a KV bucket."""

    def __init__(self, kv: KeyValue, key: str) -> None:
        self.kv = kv
        self.key = key

    async def get(self) -> tuple[int, int]:
        """`(value, revision)`; `(0, 0)` when the key was never written."""
        try:
            entry = await self.kv.get(self.key)
        except nats.js.errors.KeyNotFoundError:
            return 0, 0
        return int(entry.value or b"0"), int(entry.revision or 0)

    async def cas(self, value: int, expected_revision: int) -> int:
        """Set `value` if the key is still at `expected_revision` (0: never written); return the new revision.

        Raises CasConflict when another writer moved the key (with the value found, when a read-back saw it),
        NatsUnavailable when NATS stays away longer than `relax_bus.outage.OUTAGE_S`.
        """
        data = str(value).encode()
        started = time.monotonic()
        deadline = started + OUTAGE_S
        while True:
            try:
                if expected_revision == 0:
                    return int(await self.kv.create(self.key, data))
                return int(await self.kv.update(self.key, data, last=expected_revision))
            except nats.js.errors.KeyWrongLastSequenceError:
                raise CasConflict(self.key) from None
            except nats.js.errors.APIError as err:
                if err.err_code == WRONG_LAST_SEQUENCE:
                    raise CasConflict(self.key) from None
                if not is_transient(err):
                    raise
            except TRANSIENT as err:
                raise_if_denied(started, f"setting {self.key} to {value}")
                if time.monotonic() > deadline:
                    raise NatsUnavailable(f"setting {self.key} to {value}: NATS unavailable ({err!r})") from None
            # The write may or may not have landed: read back before trying again.
            log.info("kv_write_unconfirmed", key=self.key, value=value)
            await asyncio.sleep(0.2)
            current, revision = await through_outage(self.get, f"read {self.key}")
            if revision != expected_revision:
                if current == value:
                    return revision  # our write landed; only its answer was lost
                raise CasConflict(self.key, current)

    async def add(self, n: int, attempts: int = 50) -> int:
        """Add `n` (compare-and-set, again while other writers get there first); return the new value."""
        for _ in range(attempts):
            value, revision = await self.get()
            try:
                await self.cas(value + n, revision)
                return value + n
            except CasConflict:
                continue
            except nats.js.errors.BadRequestError:
                continue  # the server refused the revision as stale: read again
        raise CasConflict(self.key, None, f"counter {self.key} kept changing under {attempts} compare-and-set attempts")

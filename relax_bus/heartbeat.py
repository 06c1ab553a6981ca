"""Worker liveness: every worker rewrites its own heartbeat in a TTL bucket.

A worker that stops writing (crashed, hung, partitioned) disappears when its entry ages out; no
controller clock is involved. Keys are exactly `<role>.<worker_id>`.

A role's user may write any key under its own role (`$KV.<bucket>.<role>.>`), so readers trust nothing but
the key's shape and the value's agreement with it: `live_workers` skips a key of any other shape, a value
larger than the bucket's largest heartbeat, and a value whose role or worker id differs from its key's (a
worker of one role passing as another worker, or as another role), with one log line per such key. The
bucket itself bounds the value and the total (`bus.heartbeat_max_bytes`, `bus.workers_max_bytes`).

Values are JSON text, so `nats kv get relax_<run>_workers <key>` shows them as they are. Heartbeats
were msgpack (the message bodies' format) before: `read_heartbeat` still reads such an entry, so a
worker of a run started before the change stays visible until it is restarted.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time
from collections.abc import Callable

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from relax_bus.cancel import cancel_and_wait
from relax_bus.kv_keys import kv_keys
from relax_bus.log import get_logger
from relax_bus.probe import ProbeFile
from schemas import UnknownSchemaVersion, WorkerHeartbeat, decode
from schemas.messages import SCHEMA_MAJOR

log = get_logger(__name__)

REMOVE_WAIT_S = 2.0
"""How long a stopping writer waits for its entry's removal before leaving it to its TTL."""
MAX_HEARTBEAT_BYTES = 64 * 1024
"""Largest value a reader decodes when the bucket's own bound is not known (the bucket refuses larger ones)."""
KEY = re.compile(r"^(?P<role>[a-z][a-z0-9_]{0,31})\.(?P<worker_id>[A-Za-z0-9_\-.=/]{1,200})$")
"""A heartbeat key: a role name (`relax_bus.chain.Role`), a dot, a worker id."""
_reported: set[str] = set()
"""Keys already logged as skipped (one line each, whatever the polling rate)."""


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


def heartbeat_bytes(beat: WorkerHeartbeat) -> bytes:
    """A heartbeat as the workers bucket stores it: one line of JSON."""
    return beat.model_dump_json().encode()


def read_heartbeat(value: bytes) -> WorkerHeartbeat:
    """A stored heartbeat: JSON, or the msgpack of workers started before heartbeats were JSON.

    A JSON object starts with `{`; a msgpack map never does (its first byte is 0x80-0x8f, 0xde or 0xdf).
    Raises pydantic's ValidationError or a SchemaError for anything else.
    """
    if value[:1] != b"{":
        return decode(value, WorkerHeartbeat)
    beat = WorkerHeartbeat.model_validate_json(value)
    if int(beat.schema_version.split(".", 1)[0]) != SCHEMA_MAJOR:
        raise UnknownSchemaVersion(
            f"heartbeat schema version {beat.schema_version} is not supported (this code reads major {SCHEMA_MAJOR})"
        )
    return beat


class HeartbeatWriter:
    """Background task that writes `make()` to the workers bucket every `interval_s` seconds."""

    def __init__(
        self,
        kv: KeyValue,
        key: str,
        make: Callable[[], WorkerHeartbeat],
        interval_s: float,
        probe_file: ProbeFile | None = None,
    ) -> None:
        self.kv = kv
        self.key = key
        self.make = make
        self.interval_s = interval_s
        self.probe_file = probe_file
        """Where every attempt is mirrored for the container's probes (`relax_bus.probe`); None: nowhere."""
        self._task: asyncio.Task[None] | None = None
        self.last_beat_at: float | None = None
        """`time.monotonic()` when the newest beat was stored (None before the first)."""
        self._stored_at: float | None = None
        """`time.time()` when the newest beat was stored, for the probe file."""

    async def beat(self) -> None:
        """Store one beat; the probe file (if any) records the attempt, stored or not."""
        tried_at = time.time()
        try:
            await self.kv.put(self.key, heartbeat_bytes(self.make()))
            self.last_beat_at = time.monotonic()
            self._stored_at = tried_at
        finally:
            if self.probe_file is not None:
                self.probe_file.record(tried_at, self._stored_at)

    @property
    def running(self) -> bool:
        """Whether the background task is beating."""
        return self._task is not None

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
            await cancel_and_wait(self._task)
            self._task = None
        if self.probe_file is not None:
            self.probe_file.clear()
        if remove:
            # Bounded: with the server gone (stopped together with this process, as `compose down` does) the
            # delete would wait for a reply that never comes. The entry's TTL removes it anyway.
            deleting = asyncio.create_task(self.kv.delete(self.key), name=f"heartbeat-remove:{self.key}")
            await asyncio.wait({deleting}, timeout=REMOVE_WAIT_S)
            if not deleting.done():
                log.info("heartbeat_left_to_expire", key=self.key, waited_s=REMOVE_WAIT_S)
                await cancel_and_wait(deleting)
            elif isinstance(deleting.exception(), (nats.errors.Error, OSError)):
                log.debug("heartbeat_left_to_expire", key=self.key, error=type(deleting.exception()).__name__)
            else:
                deleting.result()


def heartbeat_key(role: str, worker_id: str) -> str:
    """The key of a worker's heartbeat; ValueError for a role or id a reader would not accept."""
    key = f"{role}.{worker_id}"
    if KEY.match(key) is None:
        raise ValueError(f"heartbeat key {key!r} is not <role>.<worker id>")
    return key


def beat_for_key(key: str, value: bytes, max_bytes: int = MAX_HEARTBEAT_BYTES) -> WorkerHeartbeat | None:
    """The heartbeat stored under `key`, or None (one log line per key) when the key is not `<role>.<worker id>`,
    the value is too large or unreadable, or it names another role or worker than its key."""
    shape = KEY.match(key)
    if shape is None:
        _skip(key, "heartbeat_key_refused", "not <role>.<worker id>")
        return None
    if len(value) > max_bytes:
        _skip(key, "heartbeat_too_large", f"{len(value)} bytes > {max_bytes}")
        return None
    try:
        beat = read_heartbeat(value)
    except Exception:  # tolerated: a foreign or old entry in the bucket is not a worker
        _skip(key, "heartbeat_unreadable", json.dumps(value[:60].decode(errors="replace")))
        return None
    if (beat.role, beat.worker_id) != (shape["role"], shape["worker_id"]):
        _skip(key, "heartbeat_forged", f"value claims {beat.role}.{beat.worker_id}")
        return None
    return beat


def _skip(key: str, event: str, why: str) -> None:
    """Log a skipped key once."""
    if key not in _reported:
        if len(_reported) < 4096:  # bounded: a flood of keys cannot grow it without end
            _reported.add(key)
        log.warning(event, key=key[:120], why=why[:200])


async def live_workers(kv: KeyValue, max_bytes: int = MAX_HEARTBEAT_BYTES) -> list[WorkerHeartbeat]:
    """Heartbeats of every worker whose entry has not expired and agrees with its key, sorted by role then id."""
    beats = []
    for key in await kv_keys(kv):
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue  # expired between keys() and get()
        if entry.value and (beat := beat_for_key(key, entry.value, max_bytes)) is not None:
            beats.append(beat)
    return sorted(beats, key=lambda b: (b.role, b.worker_id))

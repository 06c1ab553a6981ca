"""The container probes of a worker: its heartbeat, mirrored into a local file that `relax probe` reads.

A worker started with `relax worker ... --heartbeat-file PATH` rewrites PATH after every attempt to write its
heartbeat to the run's workers bucket (`relax_bus.heartbeat.HeartbeatWriter`): one line of JSON,

    {"tried_at": <epoch s of the last attempt>, "beat_at": <epoch s of the last stored beat, or null>,
     "ttl_s": <the bucket's TTL>, "every_s": <longest a sound loop takes between two attempts>}

so a probe costs one file read and no connection (a NATS outage must not restart every pod):

    ready   the last beat was stored at most `ttl_s` ago: the worker's entry is live in the bucket, the worker is
            connected and working (what `relax inspect` lists);
    live    the heartbeat loop attempted a beat at most 2 x `every_s` ago, stored or not: the event loop is not
            stuck. `every_s` is the beat interval plus a put's timeout (a put waits that long for a server that is
            away), so an outage keeps a worker live. No file is live: the worker has not started beating
            (connecting, loading a model) or has stopped (its last loop removes the file, as it removes its entry).

A process starting removes a file left by the one before it (`clear`), so a container restarted in the same pod
(whose /tmp outlives it) is not judged by its predecessor's beats. Standard library only: the probe runs every
few seconds in every pod.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LIVE_FACTOR = 2.0
"""`live` fails when the loop went this many times `every_s` without an attempt."""
KINDS = ("ready", "live")


@dataclass(frozen=True)
class ProbeFile:
    """The local mirror of one worker process's heartbeat."""

    path: Path
    ttl_s: float
    """The workers bucket's TTL (`bus.heartbeat_ttl_s`): a beat older than this has expired there."""
    every_s: float
    """The longest a sound heartbeat loop takes between two attempts: its interval plus a put's timeout."""

    def record(self, tried_at: float, beat_at: float | None) -> None:
        """Write the state atomically (a probe never reads half a file)."""
        text = json.dumps({"tried_at": tried_at, "beat_at": beat_at, "ttl_s": self.ttl_s, "every_s": self.every_s})
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        partial.write_text(text + "\n")
        os.replace(partial, self.path)

    def clear(self) -> None:
        """Remove the file (a stopped loop)."""
        clear(self.path)


def clear(path: Path) -> None:
    """Remove a heartbeat file (one left by an earlier process, when a process starts)."""
    path.unlink(missing_ok=True)


def verdict(kind: str, state: dict[str, Any] | None, now: float) -> tuple[bool, str]:
    """(passes, why) of probe `kind` (`ready` or `live`) for a file's `state` (None: no file) at epoch `now`.

    ready: beat_at is not None and now - beat_at <= ttl_s
    live:  state is None or now - tried_at <= LIVE_FACTOR * every_s
    """
    if kind not in KINDS:
        raise ValueError(f"unknown probe {kind!r} (known: {', '.join(KINDS)})")
    if state is None:
        return kind == "live", "no heartbeat yet (starting, or stopped)"
    if kind == "ready":
        ttl = float(state["ttl_s"])
        beat = state["beat_at"]
        if beat is None:
            return False, "no heartbeat stored yet"
        age = now - float(beat)
        return age <= ttl, f"last heartbeat stored {age:.1f}s ago (TTL {ttl:g}s)"
    limit = LIVE_FACTOR * float(state["every_s"])
    age = now - float(state["tried_at"])
    return age <= limit, f"heartbeat loop last ran {age:.1f}s ago (limit {limit:g}s)"


def probe(kind: str, path: Path, now: float | None = None) -> tuple[bool, str]:
    """Probe `kind` on the heartbeat file at `path`; an unreadable file fails either probe."""
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        state = None
    except (OSError, ValueError) as err:
        return False, f"{path}: unreadable ({type(err).__name__})"
    try:
        return verdict(kind, state, time.time() if now is None else now)
    except (KeyError, TypeError, ValueError) as err:
        return False, f"{path}: not a heartbeat file ({type(err).__name__}: {err})"

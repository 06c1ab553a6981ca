"""The container probes' verdicts (`relax_bus.probe`): ready while the last beat is inside the bucket's TTL, live
while the heartbeat loop runs, and what a missing, torn or foreign file means."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_bus.probe import LIVE_FACTOR, ProbeFile, clear, probe, verdict

pytestmark = pytest.mark.unit

TTL = 15.0
EVERY = 15.0  # the loop's interval (TTL / 3) plus a put's 10 s timeout
NOW = 1_000_000.0


def state(tried_ago: float, beat_ago: float | None) -> dict[str, float | None]:
    beat_at = None if beat_ago is None else NOW - beat_ago
    return {"tried_at": NOW - tried_ago, "beat_at": beat_at, "ttl_s": TTL, "every_s": EVERY}


@pytest.mark.parametrize(
    ("tried_ago", "beat_ago", "ready", "live"),
    [
        (1, 1, True, True),  # beating
        (TTL, TTL, True, True),  # the entry is at the edge of its TTL: still listed
        (1, TTL + 0.1, False, True),  # the loop runs but NATS refuses the beats: not ready, not to be restarted
        (1, None, False, True),  # connected to nothing yet
        (LIVE_FACTOR * EVERY, LIVE_FACTOR * EVERY, False, True),  # NATS away: puts time out, the loop goes on
        (LIVE_FACTOR * EVERY + 0.1, LIVE_FACTOR * EVERY + 0.1, False, False),  # the event loop is stuck
    ],
)
def test_ready_follows_the_stored_beat_and_live_the_loop(
    tried_ago: float, beat_ago: float | None, ready: bool, live: bool
) -> None:
    assert verdict("ready", state(tried_ago, beat_ago), NOW)[0] is ready
    assert verdict("live", state(tried_ago, beat_ago), NOW)[0] is live


def test_no_file_is_live_but_not_ready() -> None:
    """Before the first beat (connecting, loading a model) and after the loop stopped."""
    assert verdict("live", None, NOW)[0] is True
    assert verdict("ready", None, NOW)[0] is False
    with pytest.raises(ValueError, match="unknown probe"):
        verdict("started", None, NOW)


def test_the_file_round_trips_and_a_torn_or_foreign_one_fails_both(tmp_path: Path) -> None:
    path = tmp_path / "hb.json"
    ProbeFile(path, TTL, EVERY).record(tried_at=NOW - 2, beat_at=NOW - 2)
    assert json.loads(path.read_text()) == {"tried_at": NOW - 2, "beat_at": NOW - 2, "ttl_s": TTL, "every_s": EVERY}
    assert [p.name for p in tmp_path.iterdir()] == ["hb.json"]  # written through a temporary file, renamed
    assert probe("ready", path, NOW) == (True, "last heartbeat stored 2.0s ago (TTL 15s)")
    for text in ("{", "[]", '{"ttl_s": 15}'):
        path.write_text(text)
        assert probe("ready", path, NOW)[0] is False and probe("live", path, NOW)[0] is False, text
    clear(path)
    clear(path)  # a second time: nothing to remove, no error
    assert probe("live", path, NOW)[0] is True

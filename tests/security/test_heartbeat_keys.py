"""Heartbeat keys are exactly `<role>.<worker id>`, and a value must agree with its key.

A role's user may write any key under its own role's prefix of the workers bucket. Before the check a rollout
user showed up as an actor worker, or as another rollout worker, by writing a heartbeat that said so.
"""

from __future__ import annotations

import time

import pytest

from relax_bus import heartbeat
from relax_bus.heartbeat import beat_for_key, heartbeat_bytes, heartbeat_key, live_workers, process_heartbeat
from tests.bus.test_auth import Secured, provisioned, secured  # noqa: F401 (`secured` is a fixture)


def beat(run: str, role: str, worker_id: str) -> bytes:
    return heartbeat_bytes(process_heartbeat(run, role, worker_id, started_at=time.time()))


def test_keys_of_another_shape_and_values_that_disagree_are_skipped():
    run = "r1"
    assert beat_for_key("rollout.w1", beat(run, "rollout", "w1")) is not None
    assert beat_for_key("rollout.host.example.com-12-ab", beat(run, "rollout", "host.example.com-12-ab")) is not None
    for key, value in [
        ("rollout.w1", beat(run, "actor", "w1")),  # another role
        ("rollout.w2", beat(run, "rollout", "w1")),  # another worker of the role
        ("rollout", beat(run, "rollout", "")),  # no worker id
        ("Rollout.w1", beat(run, "Rollout", "w1")),  # not a role name
        ("rollout.w1", b"{" + b" " * (heartbeat.MAX_HEARTBEAT_BYTES + 1) + b"}"),  # too large to read
    ]:
        assert beat_for_key(key, value) is None, key
    assert heartbeat_key("rollout", "w1") == "rollout.w1"
    with pytest.raises(ValueError, match=r"is not <role>\.<worker id>"):
        heartbeat_key("rollout", "a b")


@pytest.mark.bus
async def test_a_role_cannot_pass_as_another_role_or_worker(secured: Secured):  # noqa: F811
    """The attack: the rollout user writes, under its own prefix, heartbeats that claim to be an actor worker and
    another rollout worker. Readers see only the real worker; each forged key is logged once."""
    admin = await provisioned(secured)
    rollout = await secured.bus("rollout")
    run = secured.config.run
    await rollout.workers.put("rollout.real", beat(run, "rollout", "real"))
    await rollout.workers.put("rollout.fake-actor", beat(run, "actor", "fake-actor"))
    await rollout.workers.put("rollout.other", beat(run, "rollout", "real"))
    await rollout.workers.put("rollout.x.y", beat(run, "rollout", "x"))
    seen = [(b.role, b.worker_id) for b in await live_workers(admin.workers)]
    assert seen == [("rollout", "real")]
    reported = {k for k in heartbeat._reported if k.startswith("rollout.")}
    assert {"rollout.fake-actor", "rollout.other", "rollout.x.y"} <= reported
    assert [(b.role, b.worker_id) for b in await live_workers(admin.workers)] == [("rollout", "real")]

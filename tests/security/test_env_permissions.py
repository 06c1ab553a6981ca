"""The environment service's users, written as the attacks: an environment server runs code a run's author chose
(the python tool runs model-written code), so its credentials are the likeliest to leak. With them nothing of the
run's streams or stores is reachable and no other run's requests can be read; the rollout, which may send
requests, cannot take them. What the service needs still works with the generated credentials."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import pytest

from relax_bus.ops.auth import permissions
from relax_bus.ops.run_report import env_instances
from relax_bus.topology import build_topology, env_subjects
from tests.bus.test_auth import Secured, provisioned, secured_server, violation
from tests.conftest import run_config
from tests.counter_env import expected
from tests.waiting import until
from workers.envs.base import EnvItem
from workers.envs.client import EnvClient
from workers.envs.service import serve_env

pytestmark = pytest.mark.bus

COUNTER = "tests.counter_env:Counter"


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[Secured]:
    async with secured_server(run_config(agent={"env": {"type": COUNTER}}), tmp_path) as s:
        yield s


async def refused(s: Secured, user: str, kind: str, subject: str) -> None:
    """Wait for the server's refusal of `kind` (publish, subscription) to `subject` to reach `user`."""
    want = violation(kind, subject)
    await until(lambda: s.violations(user), lambda seen: any(v.startswith(want[:-1]) for v in seen), 10, want)


async def test_the_service_works_with_the_generated_credentials(secured):
    s = secured
    await provisioned(s)
    env = await s.bus("env")  # the run config and its heartbeats bucket: what the role reads at start
    server = await serve_env(env.nc, env.topology, COUNTER)
    try:
        rollout = await s.connect("rollout")
        session = await EnvClient(rollout, s.config.run, timeout_s=5.0).open(EnvItem(episode="g/0/0", prompt="p"))
        assert (await session.step("abc")).observation == expected(["abc"])[0]
        await session.close()
        found = await env_instances(await s.connect("observer"), s.config.run)
        assert [(i["instance"], i["endpoints"]["step"]["requests"]) for i in found] == [(server.instance, 1)]
        for user in ("env", "rollout", "observer"):
            assert s.violations(user) == [], (user, s.errors[user])
    finally:
        await server.stop()


async def test_env_credentials_reach_no_stream_no_store_and_no_other_run(secured):
    s = secured
    admin = await provisioned(s)
    t = admin.topology
    nc = await s.connect("env")
    js = nc.jetstream(timeout=1.0)
    with pytest.raises(nats.errors.TimeoutError):  # a forged prompt into a hop
        await js.publish(t.subject("prompts"), b"forged")
    await refused(s, "env", "publish", t.subject("prompts"))
    with pytest.raises(nats.errors.TimeoutError):  # the policy's weights
        await js.object_store(t.object_store("weights"))
    await refused(s, "env", "publish", f"$JS.API.STREAM.INFO.OBJ_{t.object_store('weights')}")
    await nc.publish(t.subject("events"), b"x")  # a fake event: no stream at all, not even the events
    await refused(s, "env", "publish", t.subject("events"))
    await nc.publish(t.env.reset, b"{}")  # a request to the other servers of its own run
    await refused(s, "env", "publish", t.env.reset)

    other = env_subjects(f"{s.config.run}x")  # another run's requests: in the queue group or not
    await nc.subscribe(other.reset, queue=other.queue)
    await refused(s, "env", "subscription", other.reset)
    await nc.subscribe(other.step("*"))
    await refused(s, "env", "subscription", other.step("*"))
    # Its own run's requests only in the queue group: a plain subscription would copy every other server's.
    await nc.subscribe(t.env.reset)
    await refused(s, "env", "subscription", t.env.reset)
    assert (await admin.js.stream_info(t.stream("prompts").name)).state.messages == 0


async def test_rollout_credentials_cannot_take_the_environment_requests(secured):
    s = secured
    await provisioned(s)
    t = (await s.bus("admin")).topology
    nc = await s.connect("rollout")
    await nc.subscribe(t.env.reset, queue=t.env.queue)  # join the servers' queue group: steal resets
    await refused(s, "rollout", "subscription", t.env.reset)
    await nc.subscribe(t.env.step("*"))  # copy every instance's steps
    await refused(s, "rollout", "subscription", t.env.step("*"))
    await nc.subscribe("$SRV.PING.relax-env")  # pose as a server to discovery
    await refused(s, "rollout", "subscription", "$SRV.PING.relax-env")


def test_only_the_env_and_rollout_users_are_granted_env_subjects():
    t = build_topology(run_config(agent={"env": {"type": COUNTER}}, trainer={"kl": {"coef": 0.1}}))
    granted = {}
    for role in (*(r.name for r in t.roles), "admin", "observer"):
        p = permissions(t, role)
        granted[role] = sorted(x for x in (*p.publish, *p.subscribe) if x.startswith(t.env.prefix) or "$SRV" in x)
    assert granted.pop("env") == sorted([f"{x} env" for x in t.env.endpoints()] + list(t.env.discovery())), (
        "the endpoints in the queue group only, and the discovery subjects"
    )
    assert granted.pop("rollout") == sorted(t.env.endpoints())
    assert granted.pop("observer") == ["$SRV.STATS.relax-env"]
    assert granted == {role: [] for role in granted}, granted
    env = permissions(t, "env")
    assert env.allow_responses and not permissions(t, "rollout").allow_responses
    reads_kv = ("$JS.API.STREAM.INFO.KV_", "$JS.API.STREAM.MSG.GET.KV_", "$JS.API.DIRECT.GET.KV_")
    assert all(p.startswith((*reads_kv, f"$KV.{t.bucket('workers')}.env.")) for p in env.publish), env.publish

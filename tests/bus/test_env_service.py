"""The environment service (`workers.envs.service`) and the rollout's client (`workers.envs.client`) on a real
nats-server: two server instances in this process, each on a connection of its own, as two processes would be."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from relax_bus.connection import connect
from relax_bus.heartbeat import live_workers
from relax_bus.ops.run_report import env_instances
from relax_bus.settings import ConnectionSettings
from tests.counter_env import ClosingCounter, Counter, expected
from tests.waiting import until
from workers.envs.base import EnvItem
from workers.envs.client import EnvClient
from workers.envs.errors import EnvFailed, EnvLost
from workers.envs.service import EnvServer, ServerLimits, serve_env
from workers.roles import env as env_role
from workers.roles.serve import RoleContext

pytestmark = pytest.mark.bus

COUNTER = "tests.counter_env:Counter"
NOISY = "tests.counter_env:NoisyCounter"

Serve = Callable[..., Awaitable[EnvServer]]


@pytest.fixture
def run() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def conns(settings: ConnectionSettings) -> AsyncIterator[Callable[[], Awaitable[NATS]]]:
    """Factory of connections, every one closed after the test."""
    opened: list[NATS] = []

    async def make() -> NATS:
        opened.append(await connect(settings, name="env-test"))
        return opened[-1]

    yield make
    for nc in opened:
        if not nc.is_closed:
            await nc.close()


@pytest.fixture
async def serve(conns, run) -> AsyncIterator[Serve]:
    """Factory of server instances of `run`, each on its own connection; stopped after the test."""
    Counter.release.clear()
    servers: list[EnvServer] = []

    async def make(spec: str = COUNTER, options: dict | None = None, **limits: float) -> EnvServer:
        server = await serve_env(await conns(), run, spec, options, limits=ServerLimits(**limits))  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield make
    Counter.release.set()  # every blocked `slow` action returns
    for server in servers:
        await server.stop()


def item(n: int = 0, seed: int = 0) -> EnvItem:
    return EnvItem(episode=f"g{n}/0/0", prompt=f"p{n}", seed=seed)


async def test_each_episode_steps_on_the_instance_that_reset_it(serve, conns, run):
    a, b = await serve(), await serve()
    client = EnvClient(await conns(), run, timeout_s=5.0, retries=0)
    sessions = [await client.open(item(n, seed=n)) for n in range(8)]
    for s in sessions:
        assert s.observation == f"start {s.item.prompt} at {s.item.seed}" and s.deterministic
        for action in ("a", "bb", "ccc"):
            result = await s.step(action)
        assert result.observation == expected(["a", "bb", "ccc"], seed=s.item.seed)[-1]
        assert result.reward == 3.0 and not result.done
    held = {srv.instance: sorted(srv.episodes) for srv in (a, b)}
    assert held == {i: sorted(s.episode for s in sessions if s.instance == i) for i in (a.instance, b.instance)}
    for srv in (a, b):
        mine = sum(s.instance == srv.instance for s in sessions)
        assert srv.figures["step"].requests == 3 * mine, (srv.instance, mine)
    assert sum(srv.figures["reset"].requests for srv in (a, b)) == 8
    assert all(s.replays == 0 for s in sessions)
    await sessions[0].close()
    owner = a if sessions[0].instance == a.instance else b
    assert sessions[0].episode not in owner.episodes


async def test_stats_and_info_list_both_instances(serve, conns, run):
    a, b = await serve(), await serve()
    other_run = await serve_env(await conns(), f"{run}x", COUNTER)  # another run's server is not listed
    try:
        session = await EnvClient(await conns(), run).open(item())
        await session.step("hello")
        observer = await conns()
        found = await env_instances(observer, run)
        assert [i["instance"] for i in found] == sorted([a.instance, b.instance])
        assert {i["environment"] for i in found} == {COUNTER}
        by_instance = {i["instance"]: i["endpoints"] for i in found}
        assert sum(e["reset"]["requests"] for e in by_instance.values()) == 1
        assert by_instance[session.instance]["step"]["requests"] == 1
        assert by_instance[session.instance]["step"]["average_ms"] > 0
        assert all(e["errors"] == 0 for ends in by_instance.values() for e in ends.values())
        info = await observer.request("$SRV.INFO.relax-env", b"", timeout=5)  # one instance answers a request
        answer = json.loads(info.data)
        assert answer["metadata"]["run"] in (run, f"{run}x")
        subjects = {e["name"]: (e["subject"], e["queue_group"]) for e in answer["endpoints"]}
        instance = answer["metadata"]["instance"]
        assert subjects["step"] == (f"relax.{answer['metadata']['run']}.env.{instance}.step", "env")
        assert subjects["reset"] == (f"relax.{answer['metadata']['run']}.env.reset", "env")
    finally:
        await other_run.stop()


@pytest.mark.parametrize("how", ["stop", "close"])
async def test_a_lost_instance_is_replaced_by_a_replay_on_the_other(serve, conns, run, how):
    a, b = await serve(), await serve()
    session = await EnvClient(await conns(), run, timeout_s=2.0, retries=2).open(item(1, seed=3))
    for action in ("a", "bb"):
        await session.step(action)
    dead, alive = (a, b) if session.instance == a.instance else (b, a)
    if how == "stop":
        await dead.stop()
    else:
        await dead.nc.close()
    result = await session.step("ccc")
    assert result.observation == expected(["a", "bb", "ccc"], seed=3)[-1]  # what the dead instance would have said
    assert session.replays == 1 and session.instance == alive.instance
    assert alive.figures["step"].requests == 3, "two replayed actions, then the step itself"
    assert (await session.step("d")).observation == expected(["a", "bb", "ccc", "d"], seed=3)[-1]
    assert session.replays == 1


async def test_an_episode_resumed_elsewhere_replays_its_recorded_actions(serve, conns, run):
    await serve()
    session = await EnvClient(await conns(), run).open(item(2), actions=["x", "yy"])
    assert session.actions == ["x", "yy"] and session.replays == 0
    assert (await session.step("zzz")).observation == expected(["x", "yy", "zzz"])[-1]
    assert session.actions == ["x", "yy", "zzz"]


async def test_a_non_deterministic_environment_is_lost_with_its_instance(serve, conns, run):
    a, b = await serve(NOISY), await serve(NOISY)
    session = await EnvClient(await conns(), run, timeout_s=2.0, retries=3).open(item())
    await session.step("a")
    await (a if session.instance == a.instance else b).stop()
    with pytest.raises(EnvLost, match="not deterministic"):
        await session.step("b")
    with pytest.raises(EnvLost, match="not deterministic"):  # nor can it be resumed from recorded actions
        await EnvClient(await conns(), run).open(item(1), actions=["a"])


async def test_an_environment_exception_is_its_reply_and_the_server_goes_on(serve, conns, run):
    server = await serve()
    client = EnvClient(await conns(), run)
    session = await client.open(item())
    with pytest.raises(EnvFailed) as failed:
        await session.step("boom")
    assert failed.value.reason == "RuntimeError: boom: the counter refuses this action"
    assert session.episode not in server.episodes, "a failed episode is dropped"
    other = await client.open(item(1))
    assert (await other.step("ok")).observation == expected(["ok"])[-1]
    assert server.figures["step"].errors == 1 and "boom" in server.figures["step"].last_error


async def test_a_bad_request_and_an_unknown_episode_are_error_replies(serve, conns, run):
    server = await serve()
    nc = await conns()
    reply = await nc.request(server.subjects.reset, b"not json", timeout=5)
    assert reply.headers and reply.headers["Nats-Service-Error-Code"] == "400"
    reply = await nc.request(server.subjects.step(server.instance), b'{"episode": "nope", "action": "a"}', timeout=5)
    assert reply.headers and reply.headers["Nats-Service-Error"] == "unknown episode"


async def test_idle_episodes_are_evicted_and_replayed_when_they_come_back(serve, conns, run):
    server = await serve(idle_ttl_s=0.3)
    session = await EnvClient(await conns(), run, timeout_s=5.0, retries=1).open(item())
    await session.step("a")
    await until(lambda: dict(server.episodes), lambda held: not held, 10, "the idle episode evicted")
    assert (await session.step("bb")).observation == expected(["a", "bb"])[-1]
    assert session.replays == 1 and server.counts["evicted"] == 1


async def test_a_full_instance_refuses_a_reset(serve, conns, run):
    await serve(max_episodes=1)
    client = EnvClient(await conns(), run, timeout_s=5.0, retries=2)
    first = await client.open(item(0))
    with pytest.raises(EnvLost, match="full"):
        await client.open(item(1))
    await first.close()
    assert (await (await client.open(item(1))).step("a")).observation == expected(["a"])[-1]


async def test_a_call_past_the_servers_limit_fails_the_episode_in_bounded_time(serve, conns, run):
    await serve(call_timeout_s=0.3)
    session = await EnvClient(await conns(), run, timeout_s=10.0).open(item())
    started = time.monotonic()
    with pytest.raises(EnvFailed, match=r"timed out after 0\.3s"):
        await session.step("slow")
    assert time.monotonic() - started < 5.0


async def test_an_instance_that_never_answers_is_given_up_in_bounded_time(serve, conns, run):
    server = await serve(call_timeout_s=60.0)
    session = await EnvClient(await conns(), run, timeout_s=0.3, retries=1).open(item())
    started = time.monotonic()
    with pytest.raises(EnvLost, match="1 replays spent"):
        await session.step("slow")
    assert time.monotonic() - started < 5.0
    assert server.figures["reset"].requests == 2, "the first reset, then one replay"


async def test_a_wrong_class_or_options_fail_at_start(conns, run):
    with pytest.raises(ValueError, match="cannot import"):
        await serve_env(await conns(), run, "tests.no_such_module:Env")
    with pytest.raises(ValueError, match="bad options"):
        await serve_env(await conns(), run, COUNTER, {"nope": 1})
    assert not (await env_instances(await conns(), run, wait_s=0.2))


async def test_requests_of_different_episodes_run_at_once(serve, conns, run):
    """A slow step of one episode does not hold up another episode's step on the same instance."""
    await serve()
    client = EnvClient(await conns(), run, timeout_s=10.0)
    slow, quick = await client.open(item(0)), await client.open(item(1))
    blocked = asyncio.create_task(slow.step("slow"))
    assert (await quick.step("q")).observation == expected(["q"])[-1]
    assert not blocked.done()
    Counter.release.set()
    assert (await blocked).observation == expected(["slow"])[-1]


async def test_the_env_role_serves_the_runs_agent_env_until_stopped(make_bus, settings, tmp_path):
    bus = await make_bus(agent={"env": {"type": COUNTER, "options": {"start": 5}}})
    assert [r.name for r in bus.config.chain][-1] == "env"
    ctx = RoleContext("env", settings, bus.run, tmp_path, asyncio.Event(), bus)
    serving = asyncio.create_task(env_role.serve(ctx))
    beats = await until(lambda: live_workers(bus.workers), lambda b: [w.role for w in b] == ["env"], 10, "its beat")
    session = await EnvClient(bus.nc, bus.topology).open(item())
    assert session.instance == beats[0].worker_id and session.observation == "start p0 at 5"
    assert (await session.step("ab")).observation == expected(["ab"], start=5)[0]
    ctx.stop.set()
    await asyncio.wait_for(serving, 15)
    assert await live_workers(bus.workers) == [], "its heartbeat is removed when it stops"
    with pytest.raises(EnvLost):
        await session.step("c")


async def test_an_environment_is_closed_when_its_episode_ends(serve, conns, run):
    ClosingCounter.closed.clear()
    server = await serve("tests.counter_env:ClosingCounter", {"start": 7})
    client = EnvClient(await conns(), run, timeout_s=2.0, retries=0)
    done = await client.open(EnvItem(episode="e-done", prompt="p"))
    await done.step("stop")  # done: the server forgets it and closes its environment
    closed = await client.open(EnvItem(episode="e-closed", prompt="p"))
    await closed.close()
    await client.open(EnvItem(episode="e-held", prompt="p"))
    await until(lambda: list(ClosingCounter.closed), lambda c: len(c) == 2, timeout_s=5, what="two closed")
    await server.stop()  # what it still held is closed too
    assert ClosingCounter.closed == [7, 7, 7]


async def test_the_docs_own_environment_example_serves_as_written(serve, conns, run, tmp_path, monkeypatch):
    page = (Path(__file__).resolve().parents[2] / "docs" / "agentic.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", page, re.DOTALL) if "class WordLength" in block)
    (tmp_path / "my_envs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    await serve("my_envs:WordLength", {"limit": 32})
    session = await EnvClient(await conns(), run, timeout_s=2.0, retries=0).open(EnvItem(episode="e", prompt="p"))
    assert (await session.step("bus")).observation == "3"
    assert (await session.step('{"name": "length", "arguments": {"word": "stream"}}')).observation == "6"
    too_long = await session.step("x" * 40)
    assert too_long.observation == "error: too long" and too_long.info == {"valid": False}

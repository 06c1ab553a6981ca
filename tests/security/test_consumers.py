"""Findings 1-3: a user allowed to create a consumer can point a push consumer's delivery at any subject, an API
or advisory subject included, whatever it may publish (nats-server does not check it). With the rollout's or
the observer's credentials that reset another role's durable, forged the reaper's advisories and looped the
events and dead-letter streams into each other. No role user may create a consumer now: each attack is
refused by the server and nothing moves; the reaper also checks what an advisory names."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import pytest
from nats.aio.client import Client as NATS

from relax_bus.worker import Worker, WorkerOptions
from schemas import PromptGroup
from tests import factories as f
from tests.bus.test_auth import Secured, provisioned, secured_server, violation
from tests.bus.test_publish import read_all
from tests.conftest import run_config
from tests.waiting import until

pytestmark = pytest.mark.bus


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[Secured]:
    async with secured_server(run_config(), tmp_path) as s:
        yield s


async def push_consumer(nc: NATS, stream: str, deliver_subject: str, **config: object) -> None:
    """Ask for an ephemeral push consumer on `stream` delivering to `deliver_subject`, as raw as an attacker would."""
    ask = {"stream_name": stream, "config": {"deliver_subject": deliver_subject, "ack_policy": "none", **config}}
    await nc.request(f"$JS.API.CONSUMER.CREATE.{stream}", json.dumps(ask).encode(), timeout=1)


async def refused_consumer(s: Secured, user: str, nc: NATS, stream: str, deliver_subject: str, **config: object):
    before = len(s.violations(user))
    with pytest.raises(nats.errors.TimeoutError):
        await push_consumer(nc, stream, deliver_subject, **config)
    create = f"$JS.API.CONSUMER.CREATE.{stream}"
    await until(lambda: s.violations(user)[before:], lambda v: violation("publish", create) in v, 10, "the refusal")


async def pending(s: Secured, admin, key: str) -> int:
    t = admin.topology
    return (await admin.js.consumer_info(t.stream(key).name, t.consumer(key).durable)).num_pending


async def test_a_rollout_cannot_reset_a_durable_by_delivering_to_the_reset_api(secured):
    s = secured
    admin = await provisioned(s)
    t = admin.topology
    feeder = await s.bus("feeder")
    for i in range(5):
        await feeder.publish("prompts", f.prompt(s.config.run, i))
    nc = await s.connect("rollout")
    media = f"OBJ_{t.object_store('media')}"
    # The payload the reset API would take: skip past every prompt (the attack of finding 1).
    await nc.jetstream(timeout=2).publish(f"$O.{t.object_store('media')}.C.reset", json.dumps({"seq": 100}).encode())
    prompts, durable = t.stream("prompts").name, t.consumer("prompts").durable
    await refused_consumer(s, "rollout", nc, media, f"$JS.API.CONSUMER.RESET.{prompts}.{durable}")
    assert await pending(s, admin, "prompts") == 5, "every prompt is still there to be generated"
    assert (await admin.js.stream_info(media)).state.consumer_count == 0


async def test_a_rollout_cannot_deliver_forged_advisories_to_the_reaper(secured):
    s = secured
    admin = await provisioned(s)
    t = admin.topology
    feeder = await s.bus("feeder")
    await feeder.publish("prompts", f.prompt(s.config.run, 0))
    prompts, durable = t.stream("prompts").name, t.consumer("prompts").durable
    nc = await s.connect("rollout")
    forged = {"stream": prompts, "consumer": durable, "stream_seq": 1, "deliveries": 99}
    await nc.jetstream(timeout=2).publish(f"$O.{t.object_store('media')}.C.adv", json.dumps(forged).encode())
    advisory = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{prompts}.{durable}"
    media = f"OBJ_{t.object_store('media')}"
    await refused_consumer(s, "rollout", nc, media, advisory, deliver_group=f"relax-reaper-{durable}")
    before = len(s.violations("rollout"))
    with pytest.raises(nats.errors.TimeoutError):  # nor publish one itself
        await nc.jetstream(timeout=1).publish(advisory, json.dumps(forged).encode())
    assert s.violations("rollout")[before:] == [violation("publish", advisory)]
    assert await pending(s, admin, "prompts") == 1 and await read_all(admin, "dlq") == []


async def test_the_observer_cannot_loop_streams_into_each_other(secured):
    s = secured
    admin = await provisioned(s)
    t = admin.topology
    nc = await s.connect("observer")
    events, dlq = t.stream("events"), t.stream("dlq")
    await refused_consumer(s, "observer", nc, f"KV_{t.bucket('state')}", events.subject)
    await refused_consumer(s, "observer", nc, events.name, dlq.subject)
    await refused_consumer(s, "observer", nc, dlq.name, events.subject)
    for stream in (events.name, dlq.name):
        assert (await admin.js.stream_info(stream)).state.messages == 0


async def test_the_reaper_refuses_an_advisory_that_names_another_durable_or_too_few_deliveries(bus):
    """Defence in depth: even a message on the advisory subject (which only the server can publish once no
    role creates consumers) is taken at its word only when it names this durable past its max_deliver."""
    t = bus.topology
    for i in range(2):
        await bus.publish("prompts", f.prompt(bus.run, i))
    prompts, durable = t.stream("prompts").name, t.consumer("prompts").durable
    subject = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{prompts}.{durable}"
    max_deliver = t.consumer("prompts").max_deliver
    started, release = asyncio.Event(), asyncio.Event()

    async def hold(prompt: PromptGroup, delivery):
        started.set()
        await release.wait()
        return f.rollout(prompt)

    worker = Worker(bus, "rollout", hold, PromptGroup, WorkerOptions(fetch_timeout_s=0.2, concurrency=1))
    judged: list[object] = []
    reap = worker._reap

    async def counted_reap(advisory) -> None:  # the reaper's own decision, then a count to wait for
        await reap(advisory)
        judged.append(advisory)

    worker._reap = counted_reap  # type: ignore[method-assign]
    running = asyncio.create_task(worker.run())
    await asyncio.wait_for(started.wait(), 10)
    forged = [
        {"stream": prompts, "consumer": durable, "stream_seq": 1, "deliveries": 1},  # in flight, not given up
        {"stream": prompts, "consumer": "actor", "stream_seq": 2, "deliveries": max_deliver},
        {"stream": "OTHER", "consumer": durable, "stream_seq": 2, "deliveries": max_deliver},
    ]
    for advisory in forged:
        await bus.nc.publish(subject, json.dumps(advisory).encode())
    await bus.nc.flush()
    await until(lambda: len(judged), lambda k: k == len(forged), 10, "every forged advisory judged")
    assert (await bus.js.stream_info(prompts)).state.messages == 2, "no prompt was deleted"
    release.set()
    worker.stop()
    await asyncio.wait_for(running, 30)
    assert worker.counters.dead_lettered == 0 and await read_all(bus, "dlq") == []

"""Finding 1: a user allowed to create a consumer can point its delivery subject at a hop's subject, and the
server stores what it delivers in that hop's stream (nats-server does not check delivery subjects against
publish permissions). Such a message keeps its own subject there: the hop's durable filters on the hop's
subject and never delivers it, and the worker loop dead-letters any message whose subject is not its hop's."""

from __future__ import annotations

import asyncio

import pytest
from nats.js import api

from relax_bus.worker import Worker, WorkerOptions
from schemas import PromptGroup, encode
from tests import factories as f
from tests.bus.test_publish import read_all
from tests.waiting import until

pytestmark = pytest.mark.bus


async def _inject(bus, hop: str) -> str:
    """Deliver a media-store message into `hop`'s stream through a push consumer; return the stored subject."""
    await bus.media.put_content(encode(f.prompt(bus.run, 7, text="injected")))
    media = bus.media.stream
    stream = bus.topology.stream(hop).name
    await bus.js.add_consumer(media, api.ConsumerConfig(deliver_subject=bus.topology.subject(hop),
                                                         ack_policy=api.AckPolicy.NONE))  # fmt: skip
    info = await until(lambda: bus.js.stream_info(stream), lambda i: i.state.messages >= 1, 10, "the injected copy")
    return (await bus.js.get_msg(stream, info.state.first_seq)).subject


async def test_the_durable_never_delivers_a_message_injected_by_another_consumer(bus):
    subject = await _inject(bus, "prompts")
    assert subject != bus.topology.subject("prompts"), "stored under the media chunk's own subject"
    info = await bus.js.consumer_info(bus.topology.stream("prompts").name, bus.topology.consumer("prompts").durable)
    assert info.config.filter_subject == bus.topology.subject("prompts")
    assert not info.num_pending, "the filtered durable leaves the injected message out"


async def test_the_loop_dead_letters_a_foreign_subject_even_without_the_filter(bus):
    """An older durable without the filter (a run provisioned before it existed) still cannot be fed."""
    stream, durable = bus.topology.stream("prompts").name, bus.topology.consumer("prompts").durable
    config = (await bus.js.consumer_info(stream, durable)).config
    config.filter_subject = None
    await bus.js.add_consumer(stream, config)  # the same durable, updated in place without its filter
    await _inject(bus, "prompts")
    handled = []

    async def handler(prompt: PromptGroup, delivery):
        handled.append(prompt)

    worker = Worker(bus, "rollout", handler, PromptGroup, WorkerOptions(fetch_timeout_s=0.2))
    counters = await asyncio.wait_for(worker.run(until_empty=True), 30)
    assert handled == [] and counters.dead_lettered == 1
    (letter,) = await read_all(bus, "dlq")
    assert "not the hop's" in letter.reason and bus.topology.subject("prompts") in letter.reason

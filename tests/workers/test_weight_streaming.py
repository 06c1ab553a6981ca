"""The object store's streamed weights on a real nats-server: a reader told which version comes next follows its
upload chunk by chunk while the trainer is still writing it, takes the newest upload when a writer was cut off and
another one began, and fetches as usual when it followed nothing or another version."""

from __future__ import annotations

import asyncio
import math

import pytest
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_META_PRE_TEMPLATE

from tests.waiting import until
from tests.workers.test_shm_weights import assert_exact
from workers.weights import ObjectStoreTransport, make_transport, to_bytes

pytestmark = pytest.mark.workers


def big_state(version: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(version)
    return {"a.weight": torch.randn(1024, 1024, generator=gen), "b.weight": torch.randn(700, 1000, generator=gen)}


async def test_a_reader_has_every_chunk_before_the_upload_is_complete(make_bus, monkeypatch):
    bus = await make_bus()
    writer, reader = ObjectStoreTransport(bus), ObjectStoreTransport(bus)
    await writer.publish(0, big_state(0), step=0)
    await reader.expect(1)
    _, follower = reader._follower
    chunks = math.ceil(len(to_bytes(big_state(1))) / bus.weights.chunk_size)
    assert chunks > 4
    meta = OBJ_META_PRE_TEMPLATE.format(bucket=bus.weights.bucket, obj="")
    publish = bus.weights.js.publish

    async def record_after_every_chunk_arrived(subject, payload=b"", *args, **kwargs):
        if subject.startswith(meta):  # the object's record, written once its chunks are stored
            await until(lambda: len(follower.chunks), lambda n: n == chunks, 30, "every chunk at the reader first")
        return await publish(subject, payload, *args, **kwargs)

    monkeypatch.setattr(bus.weights.js, "publish", record_after_every_chunk_arrived)
    await writer.publish(1, big_state(1), step=1)
    assert_exact(await reader.read(1), big_state(1))
    assert reader.streamed == 1 and reader._follower is None


async def test_a_cut_off_upload_is_left_behind_for_the_one_that_completes(make_bus):
    bus = await make_bus()
    writer, reader = ObjectStoreTransport(bus), ObjectStoreTransport(bus)
    await reader.expect(2)
    dead = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bus.weights.bucket, obj="w2.cut0ff")
    for _ in range(3):  # a writer SIGKILLed after three chunks of version 2
        await bus.weights.js.publish(dead, b"x" * 1000)
    await until(lambda: len(reader._follower[1].chunks), lambda n: n == 3, 30, "the cut-off chunks followed")
    await writer.publish(2, big_state(2), step=2)  # its restarted successor publishes version 2 whole
    assert_exact(await reader.read(2), big_state(2))
    assert reader.streamed == 1


async def test_a_reader_that_followed_another_version_fetches_as_usual(make_bus):
    bus = await make_bus()
    writer, reader = ObjectStoreTransport(bus), ObjectStoreTransport(bus)
    await reader.expect(3)
    await writer.publish(1, big_state(1), step=1)
    assert_exact(await asyncio.wait_for(reader.read(1), 30), big_state(1))
    assert reader.streamed == 0 and reader._follower is None
    await writer.publish(2, big_state(2), step=2)
    await reader.expect(2)  # told after the upload: the stored chunks are replayed to it
    assert_exact(await reader.read(2), big_state(2))
    assert reader.streamed == 1


async def test_stream_false_fetches_every_version_after_its_announcement(make_bus):
    bus = await make_bus(weights={"type": "object_store", "stream": False})
    writer, reader = make_transport(bus), make_transport(bus)
    await reader.expect(1)
    assert reader._follower is None  # nothing followed, nothing downloaded ahead
    await writer.publish(1, big_state(1), step=1)
    assert_exact(await reader.read(1), big_state(1))
    assert reader.streamed == 0

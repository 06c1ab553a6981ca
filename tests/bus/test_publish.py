import asyncio
import os

import nats.errors
import nats.js.errors
import pytest
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE

from relax_bus.blobs import digest_of
from relax_bus.envelope import CLAIM, open_message
from relax_bus.errors import BlobNotFound, PublishFailed, StreamFull
from schemas import DeadLetter, PromptGroup, encode
from tests import factories as f
from tests.unit.test_schemas import every_message
from tests.waiting import until

pytestmark = pytest.mark.bus


async def read_all(bus, key):
    """Every message of a stream, decoded (claim checks resolved), read through an ordered consumer."""
    stream = bus.topology.stream(key).name
    info = await bus.js.stream_info(stream)
    out = []
    if not info.state.messages:
        return out
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg(stream, seq)
        out.append(await open_message(raw.data or b"", raw.headers, bus.media))
    return out


async def test_every_schema_round_trips_through_the_bus(bus):
    messages = [m.model_copy(update={"run": bus.run}) if hasattr(m, "run") else m for m in every_message()]
    for m in messages:
        await bus.publish("events", m)
    assert await read_all(bus, "events") == messages


async def test_duplicate_publish_is_stored_once(bus):
    p = f.prompt(bus.run, 1)
    first = await bus.publish("prompts", p)
    again = await bus.publish("prompts", p)
    assert not first.duplicate and again.duplicate
    assert (await bus.js.stream_info(bus.topology.stream("prompts").name)).state.messages == 1
    retry = p.model_copy(update={"attempt": 1})
    await bus.publish("prompts", retry)
    assert (await bus.js.stream_info(bus.topology.stream("prompts").name)).state.messages == 2


async def test_five_mib_payload_goes_through_the_claim_check(bus):
    blob = os.urandom(5 << 20)
    letter = DeadLetter(run=bus.run, reason="big", source_subject="x", stream_seq=1, payload=blob)
    await bus.publish("dlq", letter)
    raw = await bus.js.get_msg(bus.topology.stream("dlq").name, 1)
    assert raw.data == b"" or raw.data is None
    assert raw.headers[CLAIM].startswith("sha256:")
    back = await open_message(raw.data or b"", raw.headers, bus.media)
    assert back == letter and back.payload == blob
    # The same content is stored once: a second publish reuses the object.
    assert await bus.media.put_content(b"abc") == digest_of(b"abc") == await bus.media.put_content(b"abc")


async def test_missing_claim_is_a_clear_error(bus):
    with pytest.raises(BlobNotFound, match="no object"):
        await open_message(b"", {CLAIM: "sha256:" + "0" * 64}, bus.media)


async def test_oversized_payloads_fail_at_once_or_go_by_claim_check(make_bus):
    bus = await make_bus(bus={"claim_check_bytes": 64 << 20})  # asks for more than the server's max_payload
    subject = bus.topology.subject("prompts")
    limit = bus.nc.max_payload
    # Refused by the client, not a wait for an ack that never comes: waiting would outlast the 30 s bound.
    with pytest.raises(nats.errors.MaxPayloadError):
        await asyncio.wait_for(bus.js.publish(subject, b"x" * (limit + 1), timeout=600), 30)
    with pytest.raises(PublishFailed, match=rf"{limit + 1} bytes exceed the server's max_payload \({limit}\)"):
        await asyncio.wait_for(bus.publisher.publish_raw(subject, b"x" * (limit + 1), {}, deadline_s=600), 30)
    big = f.prompt(bus.run, 0, text="y" * (2 * limit))
    await bus.publish("prompts", big)  # the claim check never exceeds max_payload, whatever the config says
    raw = await bus.js.get_msg(bus.topology.stream("prompts").name, 1)
    assert raw.headers[CLAIM] == digest_of(encode(big)) and not raw.data
    assert await read_all(bus, "prompts") == [big]


async def test_blob_round_trip_sizes(bus):
    for size in (0, 1, bus.media.chunk_size, bus.media.chunk_size + 1, 3 * bus.media.chunk_size - 7):
        data = os.urandom(size)
        digest = await bus.media.put_content(data)
        assert await bus.media.get_content(digest) == data
    info = await bus.weights.put("v1", b"x" * 10)
    await bus.weights.put("v1", b"y" * 20)  # replacing purges the old chunks
    assert await bus.weights.get("v1") == b"y" * 20 and info.size == 10
    await bus.weights.delete("v1")
    with pytest.raises(BlobNotFound):
        await bus.weights.get("v1")


async def test_chunks_of_a_cut_off_upload_are_cleared_and_nothing_else(bus):
    store = bus.weights
    await store.put("kept", b"k" * (store.chunk_size + 10))  # two chunks
    await store.put("replaced", b"old")
    await store.put("replaced", b"new")  # the old chunks: cleared by put
    await store.put("deleted", b"d")
    await store.delete("deleted")
    # What a put SIGKILLed after its chunks and before its info record leaves: chunks no record names.
    cut = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=store.bucket, obj="cutoffupload")
    for _ in range(3):
        await bus.js.publish(cut, b"c" * 100)
    assert await store.clear_orphans() == 1
    assert not (await bus.js.get_last_msg(store.stream, cut)).data, "the cut-off chunks were not cleared"
    assert await store.get("kept") == b"k" * (store.chunk_size + 10)
    assert await store.get("replaced") == b"new"
    assert sorted(await store.names()) == ["kept", "replaced"]
    assert await store.clear_orphans() == 0  # cleared subjects and the live objects are left alone


async def test_full_stream_pushes_back_then_fails_clearly(make_bus, monkeypatch):
    bus = await make_bus(groups_per_step=1, bus={"hop_max_msgs": 2})
    for i in range(2):
        await bus.publish("prompts", f.prompt(bus.run, i))
    subject = bus.topology.subject("prompts")
    with pytest.raises(StreamFull, match=r"failed for 0\.5s"):
        await bus.publisher.publish(subject, f.prompt(bus.run, 9), deadline_s=0.5)

    # Room appears while the publisher waits: it gets through. The room is made only once the server
    # has refused the waiting publisher, so the publish below cannot pass without having waited.
    refused: list[str] = []
    publish = bus.publisher.js.publish

    async def counting_publish(*args, **kwargs):
        try:
            return await publish(*args, **kwargs)
        except nats.js.errors.APIError as err:
            refused.append(err.description or str(err))
            raise

    monkeypatch.setattr(bus.publisher.js, "publish", counting_publish)

    async def consume_one():
        await until(lambda: len(refused), lambda n: n >= 1, timeout_s=30, what="a refused publish")
        sub = await bus.js.pull_subscribe_bind("rollout", bus.topology.stream("prompts").name)
        (msg,) = await sub.fetch(1, timeout=2)
        await msg.ack_sync()

    consumer = asyncio.create_task(consume_one())
    ack = await bus.publisher.publish(subject, f.prompt(bus.run, 9), deadline_s=60)
    await consumer
    assert ack.seq == 3
    assert refused, "the publisher was never refused: the stream was not full while it waited"


async def test_publish_many_pipelines_and_dedupes(bus):
    subject = bus.topology.subject("prompts")
    items = [(subject, f.prompt(bus.run, i)) for i in range(50)]
    acks = await bus.publisher.publish_many(items)
    assert [a.seq for a in acks] == list(range(1, 51))
    again = await bus.publisher.publish_many(items[:5])
    assert all(a.duplicate for a in again)
    assert isinstance((await read_all(bus, "prompts"))[0], PromptGroup)

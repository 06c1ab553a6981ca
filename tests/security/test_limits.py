"""Every stream and store of a run is bounded, and a flood meets a clear error or a documented discard,
never a silent loss.

- Every stream refuses a message above `bus.max_msg_bytes` (a role that bypasses the claim check
  gets an error; the claim check itself never produces such a message).
- The media and weights stores have byte bounds: a put that does not fit fails naming the setting to
  raise, and leaves none of its chunks behind.
- The dlq and events streams have byte bounds and drop their oldest entries: dead-lettering never
  blocks a hop.
- A claim-checked hop message's object is deleted once its consumer settled it (acked or dropped),
  and kept when it is dead-lettered (the letter refers to it) or when it is a train group (replay).
"""

from __future__ import annotations

import pytest
from nats.js import api

from relax_bus import blobs
from relax_bus.connection import connect
from relax_bus.control import Drop, Reject
from relax_bus.envelope import CLAIM_PREFIX, claim_object, open_message
from relax_bus.errors import ConfigError, ProvisionFailed, PublishFailed
from relax_bus.provision import delete_run, provision
from relax_bus.settings import DEFAULT_HEADROOM, HEADER_BYTES, incompatible_changes
from relax_bus.topology import build_topology
from relax_bus.worker import Worker, WorkerOptions
from schemas import DeadLetter, PromptGroup, RunEvent, TrainGroup
from tests import factories as f
from tests.bus.test_auth import Secured, provisioned, secured  # noqa: F401 (`secured` is a fixture)
from tests.bus.test_publish import read_all
from tests.conftest import run_config
from tests.waiting import holds, until
from workers.config import parse_config

MiB = 1 << 20


def big_prompt(run: str, i: int, size: int = 300_000) -> PromptGroup:
    return f.prompt(run, i, text="y" * size)


def rollout_worker(bus, handler) -> Worker[PromptGroup]:
    return Worker(bus, "rollout", handler, PromptGroup, WorkerOptions(fetch_timeout_s=0.2))


async def claims(bus) -> list[str]:
    return sorted(n for n in await bus.media.names() if n.startswith(CLAIM_PREFIX))


async def stored(bus, key: str) -> tuple[int, int, int]:
    """(messages, bytes, first sequence) of one of the run's streams."""
    state = (await bus.js.stream_info(bus.topology.stream(key).name)).state
    return state.messages, state.bytes, state.first_seq


async def store_bytes(bus, store) -> int:
    return (await bus.js.stream_info(store.stream)).state.bytes


# ---- the topology, as data ----------------------------------------------------------------------------


def test_every_stream_and_store_is_bounded():
    config = parse_config({"run": "r1"})  # the defaults
    t = build_topology(config)
    bus = config.bus
    assert {s.key for s in t.streams} == {
        "prompts",
        "rollouts",
        "judged",
        "scored",
        "teach",
        "critique",
        "train",
        "dlq",
        "events",
    }
    for s in t.streams:
        assert s.max_msg_size == bus.claim_check_bytes + DEFAULT_HEADROOM, s
        assert s.max_msg_size >= bus.claim_check_bytes + HEADER_BYTES
        assert s.max_bytes > 0 and s.max_msg_size <= s.max_bytes, s
    assert (t.stream("dlq").discard, t.stream("events").discard) == ("old", "old")
    assert t.stream("dlq").max_bytes == bus.dlq_max_bytes and t.stream("events").max_bytes == bus.events_max_bytes
    stores = {o.key: o for o in t.object_stores}
    assert set(stores) == {"weights", "checkpoints", "media"} and stores["media"].max_bytes == bus.media_max_bytes > 0
    assert stores["media"].max_age_s == bus.media_max_age_s >= bus.train_max_age_s
    for key in ("weights", "checkpoints"):  # the trainer's alone, bounded by its retention: unbounded unless set
        assert stores[key].max_age_s == 0 and stores[key].max_bytes == -1
    assert bus.weights_max_bytes is None and bus.checkpoints_max_bytes is None
    bounded = build_topology(run_config(bus={"weights_max_bytes": 64 * MiB, "checkpoints_max_bytes": 128 * MiB}))
    assert {o.key: o.max_bytes for o in bounded.object_stores} | {"media": 0} == {
        "weights": 64 * MiB,
        "checkpoints": 128 * MiB,
        "media": 0,
    }
    buckets = {b.key: b for b in t.buckets}
    assert (buckets["state"].max_bytes, buckets["state"].max_value_size) == (bus.state_max_bytes, bus.msg_bytes_limit)
    assert (buckets["workers"].max_bytes, buckets["workers"].max_value_size) == (
        bus.workers_max_bytes,
        bus.heartbeat_max_bytes,
    )
    episodes = buckets["episodes"]
    assert (episodes.max_bytes, episodes.ttl_s) == (bus.episodes_max_bytes, bus.episodes_max_age_s)
    assert all(s.max_consumers == bus.max_consumers > 0 for s in t.streams)
    in_buckets = bus.state_max_bytes + bus.workers_max_bytes + bus.episodes_max_bytes
    assert sum(t.reserved_bytes().values()) == sum(s.max_bytes for s in t.streams) + bus.media_max_bytes + in_buckets


def test_limits_that_cannot_hold_their_contents_are_refused_at_once():
    with pytest.raises(ConfigError) as err:
        bus = {"claim_check_bytes": 256 * 1024, "max_msg_bytes": 256 * 1024, "media_max_age_s": 60}
        parse_config({"run": "r1", "bus": bus})
    (problem,) = err.value.problems
    assert "max_msg_bytes (262144) must be at least claim_check_bytes (262144) + 8192 for headers" in problem
    assert "media_max_age_s (60) must be at least train_max_age_s (604800)" in problem
    with pytest.raises(ConfigError, match=r"dlq_max_bytes \(1048576\) is smaller than the largest message"):
        run_config(bus={"claim_check_bytes": 2 * MiB, "dlq_max_bytes": MiB})
    explicit = run_config(bus={"claim_check_bytes": 64 * 1024, "max_msg_bytes": 64 * 1024 + HEADER_BYTES})
    assert all(s.max_msg_size == 64 * 1024 + HEADER_BYTES for s in build_topology(explicit).streams)


def test_the_new_limits_may_change_on_a_live_run():
    old = run_config()
    bus = {"max_msg_bytes": MiB, "dlq_max_bytes": 8 * MiB, "events_max_bytes": 8 * MiB, "media_max_bytes": 64 * MiB}
    bus |= {"media_max_age_s": 30 * 86400, "weights_max_bytes": 64 * MiB}
    assert incompatible_changes(old, run_config(run=old.run, bus=bus)) == []


# ---- on a real server ---------------------------------------------------------------------------------


@pytest.mark.bus
async def test_provisioned_limits_and_their_update_in_place(make_bus):
    bus = await make_bus()
    t = bus.topology
    for s in t.streams:
        cfg = (await bus.js.stream_info(s.name)).config
        assert (cfg.max_msg_size, cfg.max_bytes) == (s.max_msg_size, s.max_bytes), s.name
    media = (await bus.js.stream_info(bus.media.stream)).config
    weights = (await bus.js.stream_info(bus.weights.stream)).config
    assert (media.max_bytes, media.max_age) == (bus.config.bus.media_max_bytes, bus.config.bus.media_max_age_s)
    assert (weights.max_bytes, weights.max_age) == (-1, 0)  # unbounded by default: the trainer's retention
    await bus.weights.put("v0", b"w" * 1000)

    tuned = run_config(run=bus.run, bus={"media_max_bytes": 64 * MiB, "max_msg_bytes": MiB, "dlq_max_bytes": 8 * MiB})
    report = await provision(bus.js, tuned)
    assert {t.object_store("media"), t.stream("dlq").name, t.stream("prompts").name} <= set(report.updated)
    assert t.object_store("weights") in report.unchanged
    assert (await bus.js.stream_info(bus.media.stream)).config.max_bytes == 64 * MiB
    assert (await bus.js.stream_info(t.stream("train").name)).config.max_msg_size == MiB
    assert (await bus.js.stream_info(t.stream("dlq").name)).config.max_bytes == 8 * MiB
    assert (await bus.js.stream_info(bus.media.stream)).config.allow_rollup_hdrs  # still an object store
    assert await bus.weights.get("v0") == b"w" * 1000


@pytest.mark.bus
async def test_a_run_that_asks_for_more_storage_than_the_server_has_is_refused_at_init(settings):
    config = run_config(bus={"weights_max_bytes": 1 << 50})  # a PiB
    nc = await connect(settings)
    try:
        with pytest.raises(ProvisionFailed) as refused:
            await provision(nc.jetstream(), config)
        message = str(refused.value)
        assert f"cannot reserve {(1 << 50) >> 20} MiB for object store relax_{config.run}_weights" in message
        assert "(bus.weights_max_bytes)" in message and "bus.media_max_bytes" in message
        assert "max_file_store" in message
        await delete_run(nc.jetstream(), config)
    finally:
        await nc.close()


@pytest.mark.bus
async def test_a_message_over_the_size_limit_is_refused_on_every_stream(make_bus):
    bus = await make_bus(bus={"claim_check_bytes": 64 * 1024})
    limit = bus.topology.stream("prompts").max_msg_size
    assert limit == 64 * 1024 + DEFAULT_HEADROOM < bus.nc.max_payload
    # A role that bypasses the claim check floods every stream it can with oversized messages: each is refused.
    for s in bus.topology.streams:
        with pytest.raises(PublishFailed, match=rf"publish to {s.subject} refused: message size exceeds maximum"):
            await bus.publisher.publish_raw(s.subject, b"x" * (limit + 1), {}, deadline_s=5)
        assert (await stored(bus, s.key))[0] == 0, s.key
    # The same size through the publisher goes by claim check, under the limit.
    await bus.publish("prompts", big_prompt(bus.run, 0, size=limit + 1))
    assert [p.group_id for p in await read_all(bus, "prompts")] == ["g0"]


@pytest.mark.bus
async def test_a_full_media_store_refuses_clearly_and_settled_claims_make_room(make_bus):
    bus = await make_bus(bus={"claim_check_bytes": 64 * 1024, "media_max_bytes": 4 * MiB})
    published = 0
    with pytest.raises(PublishFailed) as refused:
        for i in range(40):  # 40 x 300 kB claim checks into a 4 MiB store
            await bus.publish("prompts", big_prompt(bus.run, i))
            published += 1
    message = str(refused.value)
    assert f"object store {bus.media.bucket} is full" in message and "bus.media_max_bytes" in message
    assert 5 <= published < 40
    # Nothing was lost in silence: every publish that returned is stored and readable, the refused one is not.
    assert [p.group_id for p in await read_all(bus, "prompts")] == [f"g{i}" for i in range(published)]
    assert len(await claims(bus)) == published
    assert await store_bytes(bus, bus.media) <= 4 * MiB

    seen: list[str] = []

    async def consume(prompt, delivery):
        seen.append(prompt.group_id)

    counters = await rollout_worker(bus, consume).run(until_empty=True)
    assert counters.processed == published and len(seen) == published
    assert await claims(bus) == []  # settled: their objects are gone
    assert await store_bytes(bus, bus.media) < 64 * 1024  # what remains: tombstones and rollup markers
    await bus.publish("prompts", big_prompt(bus.run, published))  # the run goes on where it was refused


@pytest.mark.bus
async def test_claims_go_with_settled_messages_and_stay_with_dead_letters(make_bus):
    bus = await make_bus(bus={"claim_check_bytes": 64 * 1024})
    for i in range(4):
        await bus.publish("prompts", big_prompt(bus.run, i))
    owned = {}
    for seq in range(1, 5):
        raw = await bus.js.get_msg(bus.topology.stream("prompts").name, seq)
        owned[seq] = claim_object(raw.headers)
    assert all(name is not None for name in owned.values()) and len(set(owned.values())) == 4

    async def handle(prompt, delivery):
        if prompt.group_id == "g1":
            raise Drop("stale")
        if prompt.group_id == "g2":
            raise Reject("bad prompt")
        if prompt.group_id == "g3":
            return f.rollout(big_prompt(bus.run, 3, size=100_000))  # an output that is claim-checked itself
        return None

    counters = await rollout_worker(bus, handle).run(until_empty=True)
    assert (counters.processed, counters.dropped, counters.dead_lettered) == (2, 1, 1)
    left = await claims(bus)  # g0's and g1's are gone; g2's (dead-lettered) and g3's output's remain
    assert owned[3] in left and len(left) == 2 and not {owned[1], owned[2], owned[4]} & set(left)
    # The dead letter still reads its payload through the copied claim headers.
    (letter,) = await read_all(bus, "dlq")
    assert isinstance(letter, DeadLetter) and claim_object(letter.headers) == owned[3]
    back = await open_message(letter.payload, letter.headers, bus.media, PromptGroup)
    assert back == big_prompt(bus.run, 2)
    # The output's claim stays until its own consumer settles it.
    (out,) = await read_all(bus, "rollouts")
    assert out.prompt.group_id == "g3"


@pytest.mark.bus
async def test_train_groups_keep_their_claims_for_replay(make_bus):
    bus = await make_bus(bus={"claim_check_bytes": 1024})
    group = TrainGroup(scored=f.scored(f.rollout(big_prompt(bus.run, 0, size=5000))))
    await bus.publish("train", group)
    raw = await bus.js.get_msg(bus.topology.stream("train").name, 1)
    name = claim_object(raw.headers)
    assert name is not None

    async def train(message, delivery):
        return None

    worker = Worker(bus, "actor", train, TrainGroup, WorkerOptions(fetch_timeout_s=0.2))
    assert (await worker.run(until_empty=True)).processed == 1
    assert await claims(bus) == [name]
    raw = await bus.js.get_msg(bus.topology.stream("train").name, 1)  # what `relax replay` reads
    assert await open_message(raw.data or b"", raw.headers, bus.media, TrainGroup) == group


@pytest.mark.bus
async def test_the_dlq_at_its_bound_drops_old_letters_and_never_blocks_a_hop(make_bus):
    bus = await make_bus(bus={"dlq_max_bytes": MiB})
    subject = bus.topology.subject("prompts")
    for i in range(30):  # 30 undecodable 100 KiB messages: 3 MiB of dead letters for a 1 MiB dlq
        await bus.js.publish(subject, b"\xc1" * (100 * 1024), headers={"Nats-Msg-Id": f"junk-{i}"})

    async def never(prompt, delivery):
        raise AssertionError("an undecodable message reached the handler")

    counters = await rollout_worker(bus, never).run(until_empty=True)
    assert counters.dead_lettered == 30 and counters.processed == 0
    messages, size, first = await stored(bus, "dlq")
    assert size <= MiB and 0 < messages < 30 and first > 1
    letters = await read_all(bus, "dlq")
    assert [d.stream_seq for d in letters] == list(range(31 - messages, 31))  # the newest are kept


@pytest.mark.bus
async def test_the_events_stream_at_its_bound_drops_old_events(make_bus):
    bus = await make_bus(bus={"events_max_bytes": MiB})
    for i in range(40):  # 40 events of 64 KiB into a 1 MiB stream
        event = RunEvent(run=bus.run, event="flood", source="test", fields={"i": i, "blob": "e" * (64 * 1024)})
        await bus.publish("events", event)
    messages, size, first = await stored(bus, "events")
    assert size <= MiB and messages < 40 and first > 1
    assert [e.fields["i"] for e in await read_all(bus, "events")] == list(range(40 - messages, 40))


@pytest.mark.bus
async def test_a_weights_version_that_does_not_fit_fails_clearly_and_leaves_nothing(make_bus, monkeypatch):
    monkeypatch.setattr(blobs, "ACK_TIMEOUT_S", 3.0)  # a refused pipelined chunk shows as a missing ack
    bus = await make_bus(bus={"weights_max_bytes": 2 * MiB})
    with pytest.raises(PublishFailed) as refused:
        await bus.weights.put("v1", b"w" * (3 * MiB))
    message = str(refused.value)
    assert f"object store {bus.weights.bucket} is full: 'v1' (3.0 MiB) does not fit" in message
    assert "bus.weights_max_bytes" in message
    assert await bus.weights.info("v1") is None
    assert await store_bytes(bus, bus.weights) < 4096  # the chunks that did fit were cleared
    await bus.weights.put("v1", b"w" * MiB)  # a version that fits goes in
    assert await bus.weights.get("v1") == b"w" * MiB
    with pytest.raises(PublishFailed, match="is full"):  # refused at its first chunk: the store has no room left
        await bus.weights.put("v2", b"w" * (2 * MiB))


@pytest.mark.bus
async def test_a_role_deletes_its_settled_claims_with_its_own_permissions(secured: Secured):  # noqa: F811
    admin = await provisioned(secured)
    feeder = await secured.bus("feeder")
    big = big_prompt(admin.run, 0, size=admin.config.bus.claim_check_bytes + 1000)
    await feeder.publish("prompts", big)
    (name,) = await claims(admin)
    rollout = await secured.bus("rollout")

    async def consume(prompt, delivery):
        assert prompt == big

    assert (await rollout_worker(rollout, consume).run(until_empty=True)).processed == 1
    assert await claims(admin) == [] and await admin.media.info(name) is None
    assert secured.violations("rollout") == [] and secured.violations("feeder") == []


# ---- KV buckets, consumers (issue 29: bounds everywhere) ----------------------------------------------


@pytest.mark.bus
async def test_a_heartbeat_flood_by_a_role_meets_the_buckets_bounds(secured: Secured):  # noqa: F811
    """The attack: as the rollout user, heartbeat keys of 1 MiB each under its own role's prefix (64 of them went
    through in half a second when the bucket had no bounds). A value is refused above `bus.heartbeat_max_bytes`,
    and keys of allowed size stop at `bus.workers_max_bytes`."""
    await provisioned(secured)
    rollout = await secured.bus("rollout")
    workers = await rollout.js.key_value(rollout.topology.bucket("workers"))
    bus = secured.config.bus
    refused = 0
    for i in range(8):
        try:
            await workers.put(f"rollout.flood-{i}", b"x" * MiB)
        except Exception:  # the server refuses the value: what this test expects
            refused += 1
    assert refused == 8
    size = bus.heartbeat_max_bytes - 256  # fits, with the key and headers
    stored = 0
    for i in range(bus.workers_max_bytes // size + 16):
        try:
            await workers.put(f"rollout.small-{i}", b"x" * size)
            stored += 1
        except Exception:  # full: the bound holds
            break
    info = (await rollout.js.stream_info(f"KV_{rollout.topology.bucket('workers')}")).state
    assert info.bytes <= bus.workers_max_bytes and stored < bus.workers_max_bytes // size + 16


@pytest.mark.bus
async def test_provision_bounds_the_buckets_and_stores_of_a_run_made_before_they_had_bounds(make_bus):
    bus = await make_bus()
    t, js = bus.topology, bus.js
    for b in t.buckets:  # as an older `relax init` left them: no byte bound, any value size, any consumer count
        cfg = (await js.stream_info(f"KV_{b.name}")).config
        cfg.max_bytes, cfg.max_msg_size, cfg.max_consumers = -1, -1, -1
        await js.update_stream(cfg)
    media = (await js.stream_info(bus.media.stream)).config
    media.max_consumers = -1
    await js.update_stream(media)

    report = await provision(js, bus.config)
    assert {b.name for b in t.buckets} | {t.object_store("media")} <= set(report.updated)
    for b in t.buckets:
        cfg = (await js.stream_info(f"KV_{b.name}")).config
        assert (cfg.max_bytes, cfg.max_msg_size, cfg.max_consumers) == (
            b.max_bytes,
            b.max_value_size,
            bus.config.bus.max_consumers,
        )
    assert (await js.stream_info(bus.media.stream)).config.max_consumers == bus.config.bus.max_consumers
    assert set((await provision(js, bus.config)).updated) == set()  # and idempotent


@pytest.mark.bus
async def test_a_stream_refuses_consumers_past_its_bound(make_bus):
    """Ephemeral consumers held open cannot take a stream's (and then the account's) every consumer slot."""
    bus = await make_bus(bus={"max_consumers": 4})
    stream = bus.topology.stream("events").name
    durables = (await bus.js.stream_info(stream)).state.consumer_count  # the metrics role's
    made = 0
    with pytest.raises(Exception, match="maximum consumers limit reached"):
        for _ in range(8):
            await bus.js.add_consumer(stream, api.ConsumerConfig(ack_policy=api.AckPolicy.NONE))
            made += 1
    assert made + durables == 4


@pytest.mark.bus
async def test_foreign_subject_messages_in_a_hop_do_not_keep_the_feeder_refused(make_bus):
    """The attack of the observer's amplification loop: a push consumer delivering into the prompts hop's subject
    filled the hop with messages under other subjects, which its filtered durable never sees and which never age
    out; the feeder was refused for good. `sweep_hops` purges exactly those subjects."""
    import asyncio

    from relax_bus.kv_counter import KvCounter
    from relax_bus.provision import sweep_hops
    from workers.roles.feeder import feed
    from workers.state_keys import FEEDER_CURSOR, TRAINER_DONE

    bus = await make_bus(groups_per_step=2, bus={"hop_max_msgs": 4}, task={"type": "addition"}, trainer={"steps": 1})
    hop = bus.topology.stream("prompts")
    for i in range(4):
        await bus.workers.put(f"flood.k{i}", b"x")
    # What any role could do before roles lost consumer creation: a push consumer delivering into the hop.
    await bus.js.add_consumer(
        f"KV_{bus.topology.bucket('workers')}",
        api.ConsumerConfig(deliver_subject=hop.subject, ack_policy=api.AckPolicy.NONE, filter_subject="$KV.*.flood.>"),
    )
    await until(lambda: stored(bus, "prompts"), lambda s: s[0] == 4, 10, "the hop full of foreign messages")

    async def released() -> int:
        return (await KvCounter(bus.state, FEEDER_CURSOR).get())[0]

    stop = asyncio.Event()
    task = asyncio.create_task(feed(bus, stop))
    try:
        await holds(released, lambda n: n == 0, 1.0, "the feeder refused by the full hop")
        purged = await sweep_hops(bus.js, bus.topology)
        assert sum(purged.values()) == 4 and hop.subject not in purged
        await until(released, lambda n: n == 2, 30, "the feeder's releases")
        await bus.state.put(TRAINER_DONE, b"1")
        await asyncio.wait_for(task, 10)
    finally:
        stop.set()
        if not task.done():
            task.cancel()
    assert await sweep_hops(bus.js, bus.topology) == {}  # the hop's own messages stay
    assert (await stored(bus, "prompts"))[0] == 2

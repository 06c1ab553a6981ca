"""Finding 2: publish ids were predictable (run/group/stage/attempt), so whoever could write to a hop (or
deliver into it through a consumer, finding 1) could store a copy under the id an honest worker was about
to use; the server then answered the honest publish `duplicate` and dropped it, and the group was lost
with no dead letter and no credit back to the feeder.

Now an id is bound to the content it names (`relax_bus.publish_ids`), and a publish answered `duplicate`
is checked against the copy stored at the ack's sequence: a copy that is not ours is left to the next
role and ours is stored again under a fresh random id. A true retry is still stored once."""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
from nats.js import api

from relax_bus import publish_ids, publisher
from relax_bus.bus import Bus
from relax_bus.envelope import CLAIM, MSG_ID, message_id, seal
from relax_bus.ops.auth import permissions
from relax_bus.publisher import Publisher
from relax_bus.topology import build_topology
from relax_bus.worker import Delivery, Worker, WorkerOptions
from schemas import DeadLetter, Message, PromptGroup, RolloutGroup, ScoredGroup, decode
from tests import factories as f
from tests.bus.test_auth import Secured, provisioned, secured_server, violation
from tests.conftest import run_config
from tests.waiting import until

pytestmark = pytest.mark.bus

GARBAGE = b"\xc1 forged, not msgpack"


async def exact_id(bus: Bus, message: Message) -> str:
    """The id the bus will publish `message` under, as anyone who can predict its bytes can work it out."""
    payload, headers = await seal(message, bus.media, bus.publisher.claim_threshold)
    return publish_ids.bind(payload, headers)[MSG_ID]


async def stored(bus: Bus, key: str) -> list[api.RawStreamMsg]:
    """Every message still in a stream, undecoded (work queues have gaps where messages were consumed)."""
    stream = bus.topology.stream(key).name
    state = (await bus.js.stream_info(stream)).state
    out = []
    for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
        try:
            out.append(await bus.js.get_msg(stream, seq))
        except nats.js.errors.NotFoundError:
            continue
    return out


def rollout_worker(bus: Bus) -> Worker[PromptGroup]:
    async def generate(prompt: PromptGroup, delivery: Delivery) -> RolloutGroup:
        return f.rollout(prompt)  # deterministic: the attacker below predicts its bytes exactly

    return Worker(bus, "rollout", generate, PromptGroup, WorkerOptions(fetch_timeout_s=0.2))


def reward_worker(bus: Bus) -> Worker[RolloutGroup]:
    async def score(rollout: RolloutGroup, delivery: Delivery) -> ScoredGroup:
        return f.scored(rollout)

    return Worker(bus, "reward", score, RolloutGroup, WorkerOptions(fetch_timeout_s=0.2))


async def run_out(worker: Worker) -> None:
    await asyncio.wait_for(worker.run(until_empty=True), 60)


async def scored_groups(bus: Bus) -> list[str]:
    """The groups the reward stage passed on (to `train` here: the run has no reference role)."""
    key = bus.topology.role("reward").output
    assert key is not None
    return sorted(decode(m.data or b"", ScoredGroup).rollout.prompt.group_id for m in await stored(bus, key))


async def test_a_forgery_consumed_first_under_the_stage_id_no_longer_swallows_the_group(bus):
    """The attack as found: garbage under `<run>/<group>/rollout/<attempt>`, consumed (and dead-lettered) by the
    next role before the rollout worker publishes. The honest rollout is not a duplicate of it any more."""
    prompt = f.prompt(bus.run, 1)
    await bus.publish("prompts", prompt)
    legacy = message_id(f.rollout(prompt))
    assert legacy == f"{bus.run}/g1/rollout/0"
    await bus.js.publish(bus.topology.subject("rollouts"), GARBAGE, headers={MSG_ID: legacy})
    reward = reward_worker(bus)
    await run_out(reward)
    assert reward.counters.dead_lettered == 1

    rollout = rollout_worker(bus)
    await run_out(rollout)
    assert rollout.counters.published == 1 and bus.publisher.ids_taken == 0
    await run_out(reward_worker(bus))
    assert await scored_groups(bus) == ["g1"], "the group goes on: nothing silently lost"
    (letter,) = [decode(m.data or b"", DeadLetter) for m in await stored(bus, "dlq")]
    assert letter.payload == GARBAGE and "undecodable" in letter.reason


class Recorder:
    """Stands in for a module's structlog logger: keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, object]]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.lines.append((level, event, fields))


async def test_a_forgery_under_the_exact_id_is_left_aside_and_ours_stored_afresh(bus, monkeypatch):
    """An attacker who predicts our bytes can compute even the bound id; the duplicate answer is checked, the
    forged copy does not match, and ours is stored again under a fresh id that nobody could take first."""
    logged = Recorder()
    monkeypatch.setattr(publisher, "log", logged)
    prompt = f.prompt(bus.run, 2)
    await bus.publish("prompts", prompt)
    taken = await exact_id(bus, f.rollout(prompt))
    forged = await bus.js.publish(bus.topology.subject("rollouts"), GARBAGE, headers={MSG_ID: taken})

    rollout = rollout_worker(bus)
    await run_out(rollout)
    assert rollout.counters.published == 1 and bus.publisher.ids_taken == 1
    first, ours = await stored(bus, "rollouts")
    assert first.seq == forged.seq and first.data == GARBAGE, "the forged copy stays, for the next role to judge"
    assert decode(ours.data or b"", RolloutGroup) == f.rollout(prompt)
    assert re.fullmatch(re.escape(taken) + r"/[0-9a-f]{16}", ours.headers[MSG_ID])
    ((level, event, fields),) = [line for line in logged.lines if line[0] != "debug"]
    assert (level, event) == ("warning", "publish_id_taken")
    assert (fields["taken_seq"], fields["seq"], fields["new_msg_id"]) == (forged.seq, ours.seq, ours.headers[MSG_ID])

    reward = reward_worker(bus)
    await run_out(reward)
    assert reward.counters.processed == 1 and reward.counters.dead_lettered == 1
    assert await scored_groups(bus) == ["g2"], "scored once: the forgery was dead-lettered"


async def test_a_copy_delivered_in_under_another_subject_cannot_swallow_a_prompt(bus):
    """Any role user may deliver into any stream through a consumer (finding 1). The feeder's prompts are
    predictable to the byte, so such a copy can carry the exact bound id; it is stored under its own subject,
    which the hop's durable never delivers, and the check sees that it is not ours."""
    prompt = f.prompt(bus.run, 7)
    payload, headers = await seal(prompt, bus.media, bus.publisher.claim_threshold)
    headers = publish_ids.bind(payload, headers)
    chunk = f"$O.{bus.topology.object_store('media')}.C.planted"
    await bus.js.publish(chunk, payload, headers=headers)
    await bus.js.add_consumer(
        bus.media.stream,
        api.ConsumerConfig(
            deliver_subject=bus.topology.subject("prompts"), filter_subject=chunk, ack_policy=api.AckPolicy.NONE
        ),
    )
    prompts = bus.topology.stream("prompts").name
    await until(lambda: bus.js.stream_info(prompts), lambda i: i.state.messages == 1, 10, "the delivered copy")

    (ack,) = await bus.publisher.publish_many([(bus.topology.subject("prompts"), prompt)])  # the feeder's path
    assert not ack.duplicate and ack.seq == 2 and bus.publisher.ids_taken == 1
    rollout = rollout_worker(bus)
    await run_out(rollout)
    assert rollout.counters.processed == 1
    assert [decode(m.data or b"", RolloutGroup).prompt for m in await stored(bus, "rollouts")] == [prompt]


async def test_an_honest_retry_is_still_stored_once(bus):
    """Exactly once kept: a retry of the same bytes is a duplicate, whether its first copy is still in the
    work queue or was consumed already; nothing is republished for it."""
    subject = bus.topology.subject("prompts")
    prompt = f.prompt(bus.run, 3)
    first = await bus.publish("prompts", prompt)
    again = await bus.publish("prompts", prompt)
    (batch,) = await bus.publisher.publish_many([(subject, prompt)])
    assert not first.duplicate and again.duplicate and batch.duplicate and again.seq == batch.seq == first.seq
    assert [m.headers[MSG_ID] for m in await stored(bus, "prompts")] == [await exact_id(bus, prompt)]

    durable, stream = bus.topology.consumer("prompts").durable, bus.topology.stream("prompts").name
    sub = await bus.js.pull_subscribe_bind(durable, stream)
    (msg,) = await sub.fetch(1, timeout=5)
    await msg.ack_sync()
    assert await stored(bus, "prompts") == []
    restarted = Publisher(bus.js, bus.media, bus.publisher.claim_threshold)  # a feeder back before its cursor moved
    late = await restarted.publish(subject, prompt)
    assert late.duplicate and late.seq == first.seq
    assert await stored(bus, "prompts") == [] and bus.publisher.ids_taken == restarted.ids_taken == 0

    big = f.prompt(bus.run, 5, text="y" * bus.publisher.claim_threshold)  # claim-checked: sealed anew each time
    first, again = [await bus.publish("prompts", big) for _ in range(2)]
    assert not first.duplicate and again.duplicate and again.seq == first.seq
    (copy,) = await stored(bus, "prompts")
    assert copy.headers[CLAIM] and not copy.data and bus.publisher.ids_taken == 0

    requeued = await bus.publish("prompts", prompt.model_copy(update={"attempt": 1}))
    assert not requeued.duplicate, "another attempt is another message"
    letter = DeadLetter(run=bus.run, reason="r", source_subject=subject, stream_seq=9, at=1.0)
    assert [bool((await bus.publish("dlq", letter)).duplicate) for _ in range(2)] == [False, True]


def test_an_id_names_its_content_and_a_fresh_id_nobody_can_predict():
    headers = {MSG_ID: "r/g1/rollout/0", "Relax-Kind": "rollout_group"}
    bound = publish_ids.bind(b"abc", headers)
    assert bound == publish_ids.bind(b"abc", dict(headers)) and bound[MSG_ID].startswith("r/g1/rollout/0/")
    assert publish_ids.bind(b"abd", headers)[MSG_ID] != bound[MSG_ID]
    assert publish_ids.bind(b"abc", {**headers, "Relax-Claim": "sha256:00"})[MSG_ID] != bound[MSG_ID]
    assert publish_ids.bind(b"abc", {"Relax-Kind": "x"}) == {"Relax-Kind": "x"}, "no id, nothing to bind"
    one, two = publish_ids.fresh(bound), publish_ids.fresh(bound)
    assert one[MSG_ID] != two[MSG_ID] and one[MSG_ID].startswith(bound[MSG_ID] + "/")


def test_each_role_may_read_back_exactly_the_streams_it_publishes_to():
    t = build_topology(run_config(run="r1", trainer={"kl": {"coef": 0.1}}))
    get = "$JS.API.STREAM.MSG.GET."
    kv_and_stores = {"KV_relax_r1_state", "KV_relax_r1_workers", "OBJ_relax_r1_media"}
    weights = {"OBJ_relax_r1_weights"}
    dlq_events = {"RELAX_r1_DLQ", "RELAX_r1_EVENTS"}
    reads = {  # what each role could read by sequence before: KV, stores, and its input when it reaps
        "feeder": kv_and_stores,
        "rollout": kv_and_stores | weights | {"RELAX_r1_PROMPTS", "KV_relax_r1_episodes"},  # episodes' records
        "reward": kv_and_stores | {"RELAX_r1_ROLLOUTS"},
        "reference": kv_and_stores | weights | {"RELAX_r1_SCORED"},
        "actor": kv_and_stores | weights | {"OBJ_relax_r1_checkpoints"},  # its own store, read by nobody else
    }
    writes = {"feeder": "PROMPTS", "rollout": "ROLLOUTS", "reward": "SCORED", "reference": "TRAIN", "actor": "PROMPTS"}
    for role, before in reads.items():
        p = permissions(t, role)
        readable = {x.removeprefix(get) for x in p.publish if x.startswith(get)}
        assert readable == before | dlq_events | {f"RELAX_r1_{writes[role]}"}, role
        direct = {x.removeprefix("$JS.API.DIRECT.GET.") for x in p.publish if ".DIRECT.GET.RELAX_" in x}
        assert direct <= dlq_events, (role, "a hop is read only through the role's durable")
        stream = t.role(role).input
        deletes = {x.removeprefix("$JS.API.STREAM.MSG.DELETE.") for x in p.publish if ".MSG.DELETE." in x}
        assert deletes == ({t.stream(stream).name} if stream and t.role(role).grants.reaps else set()), role
    observer = {x.removeprefix(get) for x in permissions(t, "observer").publish if x.startswith(get)}
    assert observer == {"KV_relax_r1_state", "KV_relax_r1_workers"} | dlq_events, "the observer reads no hop"


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[Secured]:
    async with secured_server(run_config(trainer={"kl": {"coef": 0.1}}), tmp_path) as s:
        yield s


async def test_under_per_role_credentials_a_forged_rollout_cannot_swallow_the_honest_one(secured):
    """A compromised rollout worker forges under the id the honest one will use; the honest worker (same role,
    its own connection) reads the copy back with the grant it now has, and stores its rollout afresh."""
    s = secured
    admin = await provisioned(s)
    run = s.config.run
    prompt = f.prompt(run, 4)
    await (await s.bus("feeder")).publish("prompts", prompt)
    attacker = await s.bus("rollout", name="attacker")
    taken = await exact_id(attacker, f.rollout(prompt))
    await attacker.js.publish(attacker.topology.subject("rollouts"), GARBAGE, headers={MSG_ID: taken})

    honest = await s.bus("rollout")
    rollout = rollout_worker(honest)
    await run_out(rollout)
    assert rollout.counters.published == 1 and honest.publisher.ids_taken == 1
    forged, ours = await stored(admin, "rollouts")
    assert forged.data == GARBAGE and decode(ours.data or b"", RolloutGroup).prompt == prompt
    assert s.errors["rollout"] == [] and s.errors["feeder"] == [], "the read-back is allowed"

    t = admin.topology
    for role, key in (("rollout", "train"), ("rollout", "scored"), ("feeder", "rollouts"), ("reward", "prompts")):
        name, stream = f"{role}-reads-{key}", t.stream(key).name
        js = (await s.connect(role, name=name)).jetstream(timeout=1.0)
        with pytest.raises(nats.errors.TimeoutError):
            await js.get_msg(stream, 1)
        refused = [violation("publish", f"$JS.API.STREAM.MSG.GET.{stream}")]
        await until(functools.partial(s.violations, name), refused.__eq__, 10, f"{name} refused")

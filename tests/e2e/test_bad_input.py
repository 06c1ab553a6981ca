"""Bad input at the role level: a real rollout or reward worker, built as `relax worker` builds it, on a
real nats-server, fed bad messages among good ones. Each bad one lands in the run's dead letters with
a reason that names the problem, the good ones are processed, and nothing is left pending."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest

from relax_bus.bus import Bus
from relax_bus.envelope import CLAIM
from relax_bus.worker import Worker
from schemas import (
    DeadLetter,
    ImagePart,
    MediaRef,
    Message,
    PromptGroup,
    RolloutGroup,
    TextPart,
    TrainGroup,
    encode,
)
from tests import factories as f
from tests.bus.test_publish import read_all
from tests.waiting import holds, until
from workers.data.models import materialize
from workers.data.tokenizer import BOS_ID
from workers.roles.reward import reward_worker
from workers.roles.rollout import Rollout, rollout_worker
from workers.weights import make_transport

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL = "tiny:64x2"
ROLE_CONFIG: dict[str, Any] = {"model": {"source": MODEL}, "rollout": {"max_new_tokens": 3, "batch_groups": 4}}
NO_BLOB = "sha256:" + "0" * 64


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rollout worker's cache dir, with its tiny model built once for the module."""
    work = tmp_path_factory.mktemp("work")
    materialize(MODEL, work / "base", seed=0)
    return work


@asynccontextmanager
async def rollout_role(bus: Bus, cache: Path) -> AsyncIterator[tuple[Worker[PromptGroup], Rollout]]:
    """The rollout role as `relax worker rollout` runs it, with the trainer's v0 weights published."""
    worker, rollout = await rollout_worker(bus, cache)
    await make_transport(bus).publish(0, rollout.engine.model.state_dict(), step=0)
    await bus.version.advance(0, 0)
    await rollout.start()
    try:
        yield worker, rollout
    finally:
        await rollout.stop()


async def publish_raw(bus: Bus, key: str, data: bytes, msg_id: str, **headers: str) -> None:
    await bus.js.publish(bus.topology.subject(key), data, headers={"Nats-Msg-Id": msg_id, **headers})


def other_major(message: Message, version: str) -> bytes:
    fields = msgpack.unpackb(encode(message), raw=False)
    fields["schema_version"] = version
    return msgpack.packb(fields, use_bin_type=True)


def with_image(run: str, i: int, image: ImagePart) -> PromptGroup:
    return f.prompt(run, i).model_copy(update={"parts": (TextPart(text=f"{i}+1="), image)})


def with_texts(run: str, i: int, texts: tuple[str, ...], prompt: PromptGroup | None = None) -> RolloutGroup:
    """A rollout group whose samples say `texts` (the prompt's answer is str(i + 1))."""
    base = f.rollout(prompt or f.prompt(run, i, n=len(texts)))
    return base.model_copy(update={"samples": tuple(f.said(t) for t in texts)})


async def dead_letters(bus: Bus) -> dict[int, DeadLetter]:
    """Dead letters by the stream sequence of the input they hold."""
    letters = [d for d in await read_all(bus, "dlq") if isinstance(d, DeadLetter)]
    return {d.stream_seq: d for d in letters if d.stream_seq is not None}


async def assert_settled(bus: Bus, key: str) -> None:
    """Every input of the hop was acked or terminated: nothing pending, nothing left in the work queue."""
    stream = bus.topology.stream(key).name
    info = await bus.js.consumer_info(stream, bus.topology.consumer(key).durable)
    assert (info.num_pending, info.num_ack_pending) == (0, 0)
    assert (await bus.js.stream_info(stream)).state.messages == 0


async def test_rollout_dead_letters_each_bad_prompt_and_generates_the_good_ones(make_bus, cache):
    bus = await make_bus(**ROLE_CONFIG)
    run = bus.run
    missing = "sha256:" + "ab" * 32
    present = await bus.media.put_content(b"\x89PNG a small picture")
    big = os.urandom(3 << 19)  # 1.5 MiB, above max_payload: the prompt travels by claim check
    not_utf8 = encode(f.prompt(run, 83, text="@@@")).replace(b"@@@", b"\xff\xed\xa0")
    bad = {  # stream seq -> what its dead letter's reason says
        1: "is not valid msgpack",
        2: "is not valid msgpack",
        3: "prompt_group schema version 9.0 is not supported (this code reads major 1)",
        4: "has a string that is not valid UTF-8",
        5: f"no object '{NO_BLOB.removeprefix('sha256:')}' in store relax_{run}_media",
        6: f"prompt part 1 (image) references {missing}, which is not in the media store relax_{run}_media",
        7: "prompt of 301 tokens leaves no room for rollout.max_new_tokens=3 in the model's context of 256 tokens",
        8: "prompt of 100001 tokens leaves no room",
    }
    await publish_raw(bus, "prompts", b"\xc1garbage", "bad-1")
    await publish_raw(bus, "prompts", encode(f.prompt(run, 81))[:30], "bad-2")
    await publish_raw(bus, "prompts", other_major(f.prompt(run, 82), "9.0"), "bad-3")
    await publish_raw(bus, "prompts", not_utf8, "bad-4")
    await publish_raw(bus, "prompts", b"", "bad-5", **{CLAIM: NO_BLOB})
    await bus.publish("prompts", with_image(run, 85, ImagePart(mime="image/png", ref=MediaRef(digest=missing))))
    await bus.publish("prompts", f.prompt(run, 86, text="x" * 300))
    await bus.publish("prompts", f.prompt(run, 87, text="y" * 100_000))
    good = [
        f.prompt(run, 0),
        f.prompt(run, 1, text="\x00<eos>\xff"),  # NUL, a special token's name, a two-byte character
        with_image(run, 2, ImagePart(mime="image/png", ref=MediaRef(digest=present))),
        with_image(run, 3, ImagePart(mime="image/png", inline=big)),
    ]
    for p in good:
        await bus.publish("prompts", p)

    async with rollout_role(bus, cache) as (worker, rollout):
        counters = await asyncio.wait_for(worker.run(until_empty=True), 60)

    letters = await dead_letters(bus)
    assert sorted(letters) == sorted(bad)
    for seq, why in bad.items():
        assert why in letters[seq].reason, (seq, letters[seq].reason)
        assert letters[seq].consumer == "rollout" and letters[seq].deliveries == 1
    assert letters[1].payload == b"\xc1garbage" and letters[5].headers[CLAIM] == NO_BLOB
    assert (counters.processed, counters.dead_lettered, counters.failed, counters.retried) == (4, 8, 0, 0)
    outs = {o.prompt.group_id: o for o in await read_all(bus, "rollouts") if isinstance(o, RolloutGroup)}
    assert sorted(outs) == ["g0", "g1", "g2", "g3"]
    assert outs["g1"].prompt_token_ids.to_values() == [BOS_ID, 0, *b"<eos>", 0xC3, 0xBF]
    assert outs["g3"].prompt.parts[1].inline == big  # claim-checked in, and out again inside the rollout
    for out in outs.values():  # random bytes from a random model decode (invalid UTF-8 as U+FFFD)
        for s in out.samples:
            assert s.text == rollout.tokenizer.decode(s.token_ids.to_values(), skip_special_tokens=True)
    await assert_settled(bus, "prompts")


async def test_a_full_output_hop_holds_the_input_without_losing_it(make_bus, cache):
    bus = await make_bus(**ROLE_CONFIG, groups_per_step=1, bus={"hop_max_msgs": 2, "ack_wait_s": 1, "max_deliver": 2})
    for i in (100, 101):  # the rollouts hop is full: nobody scores
        await bus.publish("rollouts", f.rollout(f.prompt(bus.run, i)))
    for i in (0, 1):
        await bus.publish("prompts", f.prompt(bus.run, i))
    # Each publish gives up after 0.5 s instead of 60 s, so the test sees the worker try again many times.
    bus.publisher.publish = functools.partial(bus.publisher.publish, deadline_s=0.5)

    async with rollout_role(bus, cache) as (worker, _):
        task = asyncio.create_task(worker.run())
        try:
            await until(lambda: worker.counters.received, lambda n: n == 2, 60, "both prompts received")
            # Held well past ack_wait x max_deliver (2 s), by the clock and by refused publishes: a nak'd or
            # expired input would be dead by then. Every poll checks that nothing was redelivered meanwhile.
            prompts = bus.topology.stream("prompts").name

            async def held() -> tuple[int, int, int]:
                info = await bus.js.consumer_info(prompts, "rollout")
                return (info.num_ack_pending, info.num_redelivered, info.num_pending)

            await holds(held, lambda h: h == (2, 0, 0), 4.0, "both inputs held, none redelivered")
            await until(lambda: worker.counters.output_full, lambda n: n >= 4, 60, "four refused publishes")
            await holds(held, lambda h: h == (2, 0, 0), 0.0, "both inputs still held")
            assert await read_all(bus, "dlq") == [] and worker.counters.processed == 0

            sub = await bus.js.pull_subscribe_bind("reward", bus.topology.stream("rollouts").name)
            for msg in await sub.fetch(2, timeout=5):  # the reward role takes the old groups: room appears
                await msg.ack_sync()
            await until(lambda: worker.counters.processed, lambda n: n == 2, 60, "both prompts generated")
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)

    outs = [o.prompt.group_id for o in await read_all(bus, "rollouts") if isinstance(o, RolloutGroup)]
    assert sorted(outs) == ["g0", "g1"]
    assert await read_all(bus, "dlq") == []
    assert (worker.counters.failed, worker.counters.retried, worker.counters.dead_lettered) == (0, 0, 0)
    await assert_settled(bus, "prompts")


async def test_reward_contains_failing_and_hanging_user_code_and_dead_letters_bad_input(make_bus):
    picky = {"type": "python", "timeout_s": 1.0, "options": {"function": "tests.workers.reward_fns:picky"}}
    bus = await make_bus(**ROLE_CONFIG, rewards=[picky])
    run = bus.run
    bad = {
        1: "is not valid msgpack",
        2: "is not valid msgpack",
        3: "rollout_group schema version 2.0 is not supported",
        4: "expected a 'rollout_group' message, got 'prompt_group'",
    }
    await publish_raw(bus, "rollouts", b"\xc1 not msgpack at all", "bad-1")
    await publish_raw(bus, "rollouts", encode(f.rollout(f.prompt(run, 81)))[:-20], "bad-2")
    await publish_raw(bus, "rollouts", other_major(f.rollout(f.prompt(run, 82)), "2.0"), "bad-3")
    await publish_raw(bus, "rollouts", encode(f.prompt(run, 83)), "bad-4")
    big = with_image(run, 2, ImagePart(mime="image/png", inline=os.urandom(3 << 19)))
    good = [
        with_texts(run, 0, ("boom", "1")),
        with_texts(run, 1, ("hang", "2")),
        with_texts(run, 2, ("3", "3"), prompt=big),  # claim-checked in and out
    ]
    for r in good:
        await bus.publish("rollouts", r)

    worker = reward_worker(bus)
    try:
        counters = await asyncio.wait_for(worker.run(until_empty=True), 60)
    finally:
        for child in multiprocessing.active_children():  # the scorer's user-code process, by its PID
            child.kill()
            child.join(5)

    letters = await dead_letters(bus)
    assert sorted(letters) == sorted(bad)
    for seq, why in bad.items():
        assert why in letters[seq].reason, (seq, letters[seq].reason)
    assert (counters.processed, counters.dead_lettered, counters.failed) == (3, 4, 0)
    scored = {t.group_id: t.scored for t in await read_all(bus, "train") if isinstance(t, TrainGroup)}
    assert sorted(scored) == ["g0", "g1", "g2"]
    assert scored["g0"].rewards == (0.0, 1.0)
    assert [d.error for d in scored["g0"].details] == ["ValueError: cannot score 'boom'", None]
    assert scored["g1"].rewards == (0.0, 1.0)
    assert [d.error for d in scored["g1"].details] == ["timed out after 1s", None]
    assert scored["g2"].rewards == (1.0, 1.0)
    assert scored["g2"].rollout.prompt.parts[1] == big.parts[1]
    await assert_settled(bus, "rollouts")

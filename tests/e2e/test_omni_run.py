"""Omni-modal runs on a real nats-server: image, audio and video prompts through every role.

The rollout role (as `relax worker rollout` builds it, tiny-omni) dead-letters each prompt whose media cannot
be read or decoded and generates the others; the actor's media check refuses prompt ids that are not its
processor's; a whole run (every role a process, two rollout workers, one SIGKILLed mid-run) trains image,
audio and video groups exactly once with media by reference and the rollout's log-probs matched on-policy."""

from __future__ import annotations

import asyncio
import io
import uuid
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from relax_bus.control import Reject
from schemas import AudioPart, ImagePart, MediaRef, PromptGroup, RolloutGroup, ScoredGroup, TextPart, TrainGroup
from schemas.parts import VideoPart
from tests import factories as f
from tests.bus.test_publish import read_all
from tests.e2e.cluster import kill_after_step, small_config
from tests.e2e.test_bad_input import dead_letters, rollout_role
from tests.e2e.test_pipeline import run
from workers.config import parse_config
from workers.data.models import materialize
from workers.data.tasks import load_task
from workers.omni.media_refs import store_inline
from workers.omni.prompts import MediaPrompter
from workers.roles.actor_media import ActorMedia
from workers.training.media_policy import media_response_logprobs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

MODEL = "tiny-omni"
ROLE_CONFIG = {"model": {"source": MODEL}, "rollout": {"max_new_tokens": 3, "batch_groups": 4}}
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("work")
    materialize(MODEL, work / "base", seed=0)
    return work


def with_parts(run: str, i: int, parts: tuple) -> PromptGroup:
    return f.prompt(run, i, n=3).model_copy(update={"parts": parts})


def wav(seconds: float, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(int(seconds * rate), dtype=np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


async def test_the_rollout_role_dead_letters_bad_media_and_samples_the_rest(make_bus, cache):
    bus = await make_bus(**ROLE_CONFIG)
    run = bus.run
    question = TextPart(text="What is it?")
    good = [await store_inline(bus.media, item.parts) for item in load_task({"type": "omni", "count": 1})]
    junk = b"these bytes are no image"
    not_png = await bus.media.put_content(junk)
    bad = {  # stream seq -> what its dead letter's reason says
        1: "which is not in the media store",
        2: "cannot decode image",
        3: "audio of 31.0 s exceeds the limit of 30.0 s",
        4: "cannot decode video",  # a truncated mp4
    }
    missing = MediaRef(digest="sha256:" + "cd" * 32)
    await bus.publish("prompts", with_parts(run, 90, (ImagePart(mime="image/png", ref=missing), question)))
    await bus.publish("prompts", with_parts(run, 91, (ImagePart(mime="image/png", ref=MediaRef(digest=not_png)),)))
    await bus.publish("prompts", with_parts(run, 92, (AudioPart(mime="audio/wav", inline=wav(31.0)), question)))
    await bus.publish("prompts", with_parts(run, 93, (VideoPart(mime="video/mp4", inline=b"\x00\x00ftyp"),)))
    for i, parts in enumerate(good):
        await bus.publish("prompts", with_parts(run, i, parts))

    async with rollout_role(bus, cache) as (worker, rollout):
        counters = await asyncio.wait_for(worker.run(until_empty=True), 120)
        engine = rollout.engine
        # Each referenced payload read once (the undecodable one too).
        sizes = [p.ref.size for g in good for p in g if p.type != "text"]
        assert rollout.payloads.fetched_bytes == sum(sizes) + len(junk)

    letters = await dead_letters(bus)
    assert sorted(letters) == sorted(bad), {s: d.reason for s, d in letters.items()}
    for seq, why in bad.items():
        assert why in letters[seq].reason, (seq, letters[seq].reason)
    assert (counters.processed, counters.dead_lettered, counters.failed) == (3, 4, 0)
    outs = {o.prompt.group_id: o for o in await read_all(bus, "rollouts") if isinstance(o, RolloutGroup)}
    assert sorted(outs) == ["g0", "g1", "g2"]
    prompter = MediaPrompter(engine.processor)
    for i, parts in enumerate(good):
        out = outs[f"g{i}"]
        assert out.prompt.parts == parts  # by reference: no payload travels with the group
        payloads = {p.ref: await bus.media.get_content(p.ref.digest) for p in parts if p.type != "text"}
        inputs = prompter.inputs(parts, payloads)
        assert out.prompt_token_ids.to_values() == inputs["input_ids"][0].tolist()
        responses = [s.token_ids.to_values() for s in out.samples]
        with torch.no_grad():
            expected = media_response_logprobs(engine.model, inputs, responses)
        for s, ref in zip(out.samples, expected, strict=True):
            assert (torch.tensor(s.logprobs.to_values()) - ref).abs().max().item() <= TOLERANCE

        # The actor's side: the same tensors from the same references, and a group whose ids differ is refused.
        media = ActorMedia(prompter, bus.media)
        group = TrainGroup(scored=ScoredGroup(rollout=out, rewards=(0.0,) * len(out.samples)))
        await media.admit(group)
        assert torch.equal(media.take([group])[0]["input_ids"], inputs["input_ids"])
        forged = out.model_copy(update={"prompt_token_ids": f.rollout(out.prompt).prompt_token_ids})
        with pytest.raises(Reject, match="not the processor's"):
            await media.admit(TrainGroup(scored=ScoredGroup(rollout=forged, rewards=(0.0,) * len(out.samples))))


@pytest.mark.parametrize("staleness", [0, 2], ids=["on-policy", "max-staleness-2"])
async def test_an_omni_run_trains_every_modality_through_a_rollout_crash(nats_server, tmp_path, staleness):
    config = parse_config(
        small_config(
            f"omni{uuid.uuid4().hex[:8]}",
            groups_per_step=3,
            model={"source": MODEL},
            task={"type": "omni", "options": {"count": 4}},
            staleness={"max_staleness": staleness},
            roles={"rollout": 2},
            trainer={"steps": 8},
        )
    )

    cluster = await run(nats_server, tmp_path, config, kill_after_step(2, "rollout"))
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        trained = set(acc.trained)
        groups = {g.group_id: g for g in acc.train_groups if g.group_id in trained}
        assert set(groups) == trained
        kinds = {p.type for g in groups.values() for p in g.scored.rollout.prompt.parts}
        assert kinds == {"image", "audio", "video", "text"}
        digests = set()
        for g in groups.values():
            for p in g.scored.rollout.prompt.parts:
                if p.type != "text":
                    assert p.inline is None and p.ref is not None and p.ref.digest is not None
                    digests.add(p.ref.digest)
        assert cluster.bus is not None
        stored = {name for name in await cluster.bus.media.names() if not name.startswith("claim/")}
        assert {d.removeprefix("sha256:") for d in digests} <= stored
        assert len(stored) <= 3 * 4  # each item's media once, however many epochs and samples read it
        steps = {m.step: m.values for m in acc.metrics}
        # reward/<modality>; the reward's terms (reward/<term>/mean) and reward/error_rate are the other reward/ names
        per_modality = {k for values in steps.values() for k in values if k.startswith("reward/") and k.count("/") == 1}
        assert per_modality - {"reward/error_rate"} == {"reward/image", "reward/audio", "reward/video"}, per_modality
        assert all(values["processor_s"] > 0 and values["media_bytes"] > 0 for values in steps.values())
        if staleness == 0:  # the trainer holds the very weights that sampled each group
            worst = max(values["logprob_mismatch"] for values in steps.values())
            assert worst <= TOLERANCE, worst
    finally:
        await cluster.stop()

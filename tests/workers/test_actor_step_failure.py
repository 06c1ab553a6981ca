"""A step that raises on its batch, or a sequence longer than the model's context, must not crash-loop the actor
(finding 5): the failing batch is tried `trainer.step_tries` times, then dead-lettered with the error, and the actor
trains the next batch; a group longer than the model can take is dead-lettered before it is held. Real nats-server,
real trainer on the tiny model."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from schemas import DeadLetter, RunEvent, TrainGroup, WireTensor
from tests import factories as f
from tests.bus.test_publish import read_all
from tests.e2e.cluster import small_config
from workers.config import parse_config
from workers.data.models import materialize
from workers.data.tokenizer import EOS_ID
from workers.roles.actor import Actor
from workers.training.trainer import PolicyTrainer
from workers.weights import ObjectStoreTransport

pytestmark = [pytest.mark.workers, pytest.mark.bus]


class UncheckedTrainer(PolicyTrainer):
    """A trainer whose admission check misses what its step cannot take: the step itself raises on such a group."""

    def untrainable(self, group: TrainGroup) -> str | None:
        return None


def with_sample_ids(group: TrainGroup, ids: list[int]) -> TrainGroup:
    """`group` whose first sample's token ids are `ids`."""
    rollout = group.scored.rollout
    first = rollout.samples[0].model_copy(
        update={
            "token_ids": WireTensor.from_values(ids, "int32"),
            "logprobs": WireTensor.from_values([-0.5] * len(ids), "float32"),
        }
    )
    rollout = rollout.model_copy(update={"samples": (first, *rollout.samples[1:])})
    return group.model_copy(update={"scored": group.scored.model_copy(update={"rollout": rollout})})


def trained_groups(events: list[object]) -> list[str]:
    return [
        g
        for e in events
        if isinstance(e, RunEvent) and e.event == "step_trained"
        for g in e.fields["groups"].split(",")
    ]


async def test_a_batch_the_step_cannot_take_is_dead_lettered_and_the_next_batch_trains(
    make_bus, tmp_path, one_torch_thread
):
    config = parse_config(
        small_config(
            f"stepfail{uuid.uuid4().hex[:8]}",
            groups_per_step=2,
            samples_per_group=2,
            trainer={"steps": 2, "step_tries": 2, "checkpoint": {"every": 10}},
        )
    )
    bus = await make_bus(config)
    trainer = UncheckedTrainer(materialize("tiny:64x2", tmp_path / "m", seed=0), config)
    actor = Actor(bus, trainer, ObjectStoreTransport(bus))
    await actor.setup([])
    run = config.run
    poisoned = with_sample_ids(f.train(run, 0), [7, 1 << 20, EOS_ID])  # an id past the embedding: the step raises
    for group in (poisoned, *(f.train(run, i) for i in range(1, 6))):
        await bus.publish("train", group)

    assert await asyncio.wait_for(actor.run(asyncio.Event()), 120) == 2  # no crash: it went on to the next batches
    letters = [m for m in await read_all(bus, "dlq") if isinstance(m, DeadLetter)]
    reasons = sorted({letter.reason for letter in letters})
    assert len(letters) == 2 and len(reasons) == 1, reasons  # the whole first batch: g0 and g1
    assert reasons[0].startswith("step 1 failed 2 times on this batch, last: IndexError"), reasons
    assert sorted(trained_groups(await read_all(bus, "events"))) == ["g2", "g3", "g4", "g5"]
    assert actor.worker.counters.dead_lettered == 2


async def test_a_sequence_longer_than_the_model_context_is_dead_lettered_not_trained(
    make_bus, tmp_path, one_torch_thread
):
    config = parse_config(
        small_config(
            f"seqcap{uuid.uuid4().hex[:8]}",
            groups_per_step=2,
            samples_per_group=2,
            trainer={"steps": 1, "checkpoint": {"every": 10}},
        )
    )
    bus = await make_bus(config)
    trainer = PolicyTrainer(materialize("tiny:64x2", tmp_path / "m", seed=0), config)
    assert trainer.max_tokens == 256
    actor = Actor(bus, trainer, ObjectStoreTransport(bus))
    await actor.setup([])
    run = config.run
    long = with_sample_ids(f.train(run, 0), [55] * 300 + [EOS_ID])
    for group in (long, f.train(run, 1), f.train(run, 2)):
        await bus.publish("train", group)

    assert await asyncio.wait_for(actor.run(asyncio.Event()), 120) == 1
    (letter,) = await read_all(bus, "dlq")
    assert "sample 0: 3 prompt + 301 response tokens exceed the model's context of 256 positions" in letter.reason
    assert sorted(trained_groups(await read_all(bus, "events"))) == ["g1", "g2"]

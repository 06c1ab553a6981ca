"""The stub bus settles a message as the worker loop does: a handler's outcome on a `StubBus` is the
ack / drop / retry / dead letter that `Worker._settle` gives it on a real server (tests/bus/test_worker.py)."""

from __future__ import annotations

import uuid

import pytest

from relax_bus.control import Drop, Reject, Retry, Skip
from relax_bus.delivery import Delivery, WorkerOptions
from relax_bus.stub import StubBus
from relax_bus.worker import Worker
from schemas import DeadLetter, RolloutGroup, RunEvent, TrainGroup
from tests import factories as f
from workers.config import PipelineConfig, parse_config

BACKOFF = (0.5, 2.0)


def stub_bus() -> StubBus[PipelineConfig]:
    config = parse_config(
        {"run": f"t{uuid.uuid4().hex[:10]}", "groups_per_step": 2, "samples_per_group": 2, "bus": {"max_deliver": 3}}
    )
    return StubBus.of(config)


def raising(err: BaseException) -> Worker[RolloutGroup]:
    async def handle(group: RolloutGroup, delivery: Delivery) -> None:
        raise err

    return Worker(stub_bus(), "reward", handle, RolloutGroup, WorkerOptions(retry_backoff_s=BACKOFF))


@pytest.mark.parametrize(
    ("err", "outcome", "reason", "delay"),
    [
        (Skip(), "ack", None, None),
        (Drop("too old"), "drop", "too old", None),
        (Reject("forged"), "dead_letter", "forged", None),
        (Retry(3.0, "busy"), "retry", None, 3.0),
        (RuntimeError("bug"), "retry", None, BACKOFF[0]),
    ],
)
async def test_a_first_delivery_is_settled_by_the_loops_mapping(err, outcome, reason, delay) -> None:
    worker = raising(err)
    bus = worker.bus
    assert isinstance(bus, StubBus)
    handled = await bus.deliver(worker, f.rollout(f.prompt(bus.run, 0)))
    assert (handled.outcome, handled.reason, handled.delay) == (outcome, reason, delay), handled
    assert handled.on("scored") == handled.on("train") == []
    if outcome == "drop":
        (event,) = handled.on("events")
        assert isinstance(event, RunEvent) and event.event == "message_dropped"
    if outcome == "dead_letter":
        (letter,) = handled.on("dlq")
        assert isinstance(letter, DeadLetter) and letter.consumer == "reward" and letter.deliveries == 1


@pytest.mark.parametrize("err", [Retry(1.0, "busy"), RuntimeError("bug")])
async def test_the_last_delivery_of_a_failing_message_is_dead_lettered(err) -> None:
    worker = raising(err)
    bus = worker.bus
    assert isinstance(bus, StubBus)
    second = await bus.deliver(worker, f.rollout(f.prompt(bus.run, 0)), deliveries=2)
    assert second.outcome == "retry" and second.delay == (BACKOFF[1] if isinstance(err, RuntimeError) else 1.0)
    last = await bus.deliver(worker, f.rollout(f.prompt(bus.run, 0)), deliveries=3)
    assert last.outcome == "dead_letter", last
    assert last.reason is not None and ("gave up after 3" in last.reason or "failed 3 times" in last.reason)
    assert worker.counters.dead_lettered == 1


async def test_outputs_go_to_the_roles_hop_and_a_republished_id_is_a_duplicate() -> None:
    bus = stub_bus()

    async def handle(group: RolloutGroup, delivery: Delivery) -> TrainGroup:
        return TrainGroup(scored=f.scored(group))  # the run has no reference role: reward writes `train`

    worker = Worker(bus, "reward", handle, RolloutGroup)
    group = f.rollout(f.prompt(bus.run, 0))
    first = await bus.deliver(worker, group)
    again = await bus.deliver(worker, group, deliveries=2)  # the same output again: the server keeps one
    assert first.outcome == again.outcome == "ack"
    assert len(first.on("train")) == 1 and again.published == ()
    assert len(bus.published("train")) == 1 and worker.counters.published == 2

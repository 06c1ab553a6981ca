"""The reward role's handler on a stub bus (`relax_bus.stub`): no server, milliseconds per test.

The handler runs inside a real `Worker`, so each message is settled by the loop's own mapping; these tests
check what the reward logic decides: its output and where it goes, dynamic sampling's filtered set, and
the refusal of a prompt the task never released.
"""

from __future__ import annotations

import uuid

from relax_bus.stub import StubBus
from schemas import RolloutGroup, RunEvent, ScoredGroup, TrainGroup
from tests import factories as f
from workers.config import PipelineConfig, parse_config, task_seed, task_spec
from workers.data.tasks import load_task
from workers.roles.filtered_credit import holds, read_filtered
from workers.roles.reward import TrustedTask, reward_worker


def stub_bus(**overrides: object) -> StubBus[PipelineConfig]:
    config = parse_config(
        {"run": f"t{uuid.uuid4().hex[:10]}", "groups_per_step": 2, "samples_per_group": 2, **overrides}
    )
    return StubBus.of(config)


def answered(bus: StubBus[PipelineConfig], i: int, texts: tuple[str, ...]) -> RolloutGroup:
    """Release `i` of the addition task (its answer is `i + 1`) with one sample per text."""
    group = f.rollout(f.prompt(bus.run, i, n=len(texts)))
    return group.model_copy(update={"samples": tuple(f.said(t) for t in texts)})


async def test_each_sample_is_scored_against_the_answer_and_goes_to_train_without_a_reference() -> None:
    bus = stub_bus()
    worker = reward_worker(bus)
    handled = await bus.deliver(worker, answered(bus, 0, ("1", "7")))
    assert handled.outcome == "ack", handled
    (out,) = handled.on("train")
    assert isinstance(out, TrainGroup)
    assert out.scored.rewards[0] > out.scored.rewards[1], out.scored.rewards  # "1" is 0+1; "7" is not
    assert [d.error for d in out.scored.details] == [None, None]
    assert handled.on("scored") == [] and bus.published("train") == [out]
    assert worker.counters.processed == 1


async def test_with_a_reference_role_the_scored_group_goes_to_scored() -> None:
    bus = stub_bus(trainer={"kl": {"coef": 0.1}})
    handled = await bus.deliver(reward_worker(bus), answered(bus, 0, ("1", "7")))
    assert handled.outcome == "ack", handled
    (out,) = handled.on("scored")
    assert isinstance(out, ScoredGroup) and handled.on("train") == []


async def test_a_uniform_group_is_filtered_once_and_a_copy_of_it_is_skipped() -> None:
    bus = stub_bus(sampling={"drop_uniform": True})
    worker = reward_worker(bus)
    uniform = answered(bus, 3, ("7", "8"))  # both wrong: equal rewards, zero advantages

    first = await bus.deliver(worker, uniform)
    assert first.outcome == "ack" and first.on("train") == [], first
    (event,) = first.on("events")
    assert isinstance(event, RunEvent) and event.event == "group_filtered"
    assert event.fields["release_index"] == 3 and event.fields["filtered"] == 1, event.fields
    bitmap, _ = await read_filtered(bus.state)
    assert holds(bitmap, 3) and not holds(bitmap, 2)

    again = await bus.deliver(worker, uniform, deliveries=2)  # redelivered: the credit is not given twice
    assert again.outcome == "ack" and again.on("train") == [], again
    assert [e.fields["filtered"] for e in again.on("events")] == [1]

    # The same release scored again with other samples (published again after a crash): not trained.
    copy = await bus.deliver(worker, answered(bus, 3, ("4", "8")))
    assert copy.outcome == "ack" and copy.published == (), copy
    assert worker.counters.skipped == 3 and bus.published("train") == []


async def test_a_prompt_the_task_never_released_is_dead_lettered() -> None:
    bus = stub_bus()
    task = TrustedTask(load_task(task_spec(bus.config.task)), task_seed(bus.config.task))
    forged = answered(bus, 0, ("1", "1"))  # the factory's prompt is not the task's release 0
    handled = await bus.deliver(reward_worker(bus, task=task), forged)
    assert handled.outcome == "dead_letter", handled
    assert handled.reason is not None and "does not match the task's release" in handled.reason, handled.reason
    assert handled.on("train") == [] and len(handled.on("dlq")) == 1

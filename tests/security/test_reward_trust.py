"""Finding 6, the reward side: a rollout worker writes the message the reward role scores, answer included,
so a compromised one could rewrite the answer to match its completions. The reward role recomputes the
release from the run's task and refuses a group whose prompt or answer is not the one released."""

from __future__ import annotations

import asyncio

import pytest

from relax_bus.control import Reject
from relax_bus.worker import WorkerOptions
from schemas import TextPart, TrainGroup, WireTensor
from tests import factories as f
from tests.bus.test_auth import provisioned, secured_server
from tests.bus.test_publish import read_all
from tests.conftest import run_config
from workers.config import task_seed, task_spec
from workers.data.tasks import TaskItem, load_task
from workers.roles.feeder import group_for
from workers.roles.reward import TrustedTask, reward_worker

pytestmark = pytest.mark.bus


async def test_a_rewritten_answer_or_prompt_is_dead_lettered_and_the_honest_group_scored(bus):
    cfg = bus.config
    items, seed = load_task(task_spec(cfg.task)), task_seed(cfg.task)
    honest = [group_for(bus.run, 2, items, i, 0, seed) for i in range(3)]
    forged = [
        honest[1].model_copy(update={"answer": "0"}),  # the answer the completions happen to give
        honest[2].model_copy(update={"parts": (TextPart(text="0+0="),)}),  # an easier question
    ]
    for prompt in (honest[0], *forged):
        await bus.publish("rollouts", f.rollout(prompt))
    worker = reward_worker(bus, WorkerOptions(fetch_timeout_s=0.2), task=TrustedTask(items, seed))
    counters = await asyncio.wait_for(worker.run(until_empty=True), 60)
    scored = await read_all(bus, bus.topology.role("reward").output)
    letters = await read_all(bus, "dlq")
    assert [s.scored.rollout.prompt.group_id if hasattr(s, "scored") else s.rollout.prompt.group_id
            for s in scored] == [honest[0].group_id]  # fmt: skip
    assert counters.dead_lettered == 2 and len(letters) == 2
    assert "answer differ" in letters[0].reason and "prompt differ" in letters[1].reason, [x.reason for x in letters]


async def test_the_trusted_answer_is_the_one_scored(bus):
    cfg = bus.config
    items, seed = load_task(task_spec(cfg.task)), task_seed(cfg.task)
    task = TrustedTask(items, seed)
    prompt = group_for(bus.run, 2, items, 5, 0, seed)
    assert task.answer(prompt) == items[prompt.index].answer == prompt.answer


async def test_a_rollout_whose_text_and_token_ids_disagree_is_scored_by_its_ids(tmp_path):
    """Finding 5, reward integrity: the actor trains a sample's token ids, so a rollout worker that sends the right
    answer as text beside other ids (`'7'` with ids `[7, 7]`) must not have those ids rewarded."""
    config = run_config(task={"type": "addition", "options": {"seed": 5}})
    async with secured_server(config, tmp_path) as s:
        admin = await provisioned(s)
        items, seed = load_task(task_spec(config.task)), task_seed(config.task)
        prompt = group_for(config.run, 2, items, 0, 0, seed)
        right = prompt.answer or ""
        forged = f.said(right).model_copy(update={"token_ids": WireTensor.from_values([7] * len(right) + [7], "int32")})
        honest = f.said(right)
        group = f.rollout(prompt).model_copy(update={"samples": (forged, honest)})
        await (await s.bus("rollout", name="attacker")).publish("rollouts", group)

        worker = reward_worker(await s.bus("reward"), WorkerOptions(fetch_timeout_s=0.2), task=TrustedTask(items, seed))
        counters = await asyncio.wait_for(worker.run(until_empty=True), 60)
        assert counters.processed == 1, counters
        (out,) = await read_all(admin, admin.topology.role("reward").output)
        scored = out.scored if isinstance(out, TrainGroup) else out
        assert scored.rewards[1] == 1.0, "the honest sample says the answer in its ids and its text"
        assert scored.rewards[0] == 0.0, f"ids {forged.token_ids.to_values()} were scored as {right!r}"
        assert scored.rollout.samples[0].text == "\x07" * (len(right) + 1), "the text trained is the text scored"


def test_rewritten_columns_are_refused_like_a_rewritten_answer():
    items = [TaskItem((TextPart(text="2+2="),), "4", "hf", 0, columns={"level": 1})]
    task = TrustedTask(items, None)
    honest = group_for("r", 2, items, 0, 0)
    assert honest.columns == {"level": 1} and task.answer(honest) == "4"
    with pytest.raises(Reject, match="columns differ"):
        task.answer(honest.model_copy(update={"columns": {"level": 9}}))

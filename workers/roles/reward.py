"""The reward role: scores every sample of a rollout group.

Rewards come from the run config (`rewards:`), or the task's default; the answer each group is scored
against comes from the run's task, not from the message (`TrustedTask`). User code is contained by the
scorer (timeout, exceptions become a zero reward with the error recorded), so one bad sample never
kills the worker. Output goes to `scored` when the reference role is in the chain, else straight to
`train`.

Dynamic sampling (`sampling.drop_uniform`): a group whose rewards are all equal has zero advantages, so it is
not published; it is recorded in the run's filtered set (`workers.roles.filtered_credit`, which returns its
credit to the feeder, once however often the group is redelivered), announced with a `group_filtered` event
and acked. A copy of a group already filtered (published again after a crash) is acked without output too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from relax_bus.bus import Bus
from relax_bus.control import Reject, Skip
from relax_bus.errors import ConfigError
from relax_bus.log import get_logger
from relax_bus.worker import Delivery, Worker, WorkerOptions
from schemas import PromptGroup, RewardDetail, RolloutGroup, RunEvent, ScoredGroup, TrainGroup
from workers.config import PipelineConfig, task_seed, task_spec
from workers.data.tasks import TaskItem, load_task
from workers.omni.media_refs import by_reference
from workers.rewards.scorer import Scorer, default_rewards
from workers.roles.feeder import released_item
from workers.roles.filtered_credit import holds, is_uniform, read_filtered, record_filtered
from workers.roles.serve import RoleContext, run_worker

log = get_logger(__name__)


def make_scorer(bus: Bus) -> Scorer:
    """The run's scorer: configured reward terms, or the task's default."""
    return make_scorer_from(bus.config)


def make_scorer_from(cfg: PipelineConfig) -> Scorer:
    """A scorer for a run config (also used to check the config before a run starts)."""
    return Scorer(list(cfg.rewards) or default_rewards(_task_name(cfg)))


def _task_name(cfg: PipelineConfig) -> str:
    """The task name the items carry (a jsonl file may name its own), which picks the default reward."""
    options = cfg.task.options
    return str(getattr(options, "task", cfg.task.type))


async def serve(ctx: RoleContext) -> None:
    """`relax worker reward`: the run's task is loaded, so every group is scored against its own answer."""
    cfg = ctx.connected.config
    task = TrustedTask(load_task(task_spec(cfg.task)), task_seed(cfg.task))
    await run_worker(ctx, reward_worker(ctx.connected, task=task))


@dataclass(frozen=True)
class TrustedTask:
    """The run's task as the feeder releases it: what a rollout's prompt must be, and the answer to score with.

    A rollout worker writes the message the reward role reads, prompt and answer included; a compromised
    one could rewrite the answer to match its completions. The reward role recomputes the release from
    the task instead and refuses a group whose prompt is not the one released under its index."""

    items: list[TaskItem]
    seed: int | None

    def answer(self, prompt: PromptGroup) -> str | None:
        """The trusted answer of `prompt`; Reject when the prompt is not what the feeder released."""
        group_id, item = released_item(self.items, prompt.release_index, self.seed)
        differs = [
            what
            for what, ours, theirs in (
                ("group id", group_id, prompt.group_id),
                ("prompt", by_reference(item.parts), prompt.parts),
                ("history", item.history, prompt.history),
                ("answer", item.answer, prompt.answer),
            )
            if ours != theirs
        ]
        if differs:
            raise Reject(
                f"group {prompt.group_id} (release {prompt.release_index}) does not match the task's release: "
                f"{', '.join(differs)} differ"
            )
        return item.answer


def score_group(scorer: Scorer, group: RolloutGroup, worker_id: str = "", answer: str | None = None) -> ScoredGroup:
    """Score each sample against `answer` (default: the one the message carries); failures are zero
    rewards with the error in the details."""
    rewards, details = [], []
    answer = group.prompt.answer if answer is None else answer
    for sample in group.samples:
        reward, components, error = scorer.score(sample.text, answer, sample.finish_reason)
        rewards.append(reward)
        details.append(RewardDetail(components=components, error=error))
    return ScoredGroup(rollout=group, rewards=tuple(rewards), details=tuple(details), worker_id=worker_id)


def reward_worker(
    bus: Bus, options: WorkerOptions | None = None, task: TrustedTask | None = None
) -> Worker[RolloutGroup]:
    """A Worker running the reward handler on the run's rollouts; with `task`, each group's prompt is checked
    against the task's release and scored with the task's answer (the role always passes it)."""
    scorer = make_scorer(bus)
    options = options or WorkerOptions(concurrency=4)
    to_train = bus.topology.role("reward").output == "train"
    one_at_a_time = asyncio.Lock()  # the scorer's user-code child serves one call at a time
    drop_uniform = bus.config.sampling.drop_uniform
    if drop_uniform and bus.config.samples_per_group < 2:
        raise ConfigError(
            "sampling.drop_uniform",
            [f"samples_per_group is {bus.config.samples_per_group}: a group of one sample is always uniform"],
        )
    worker_id = options.worker_id

    async def handle(group: RolloutGroup, delivery: Delivery) -> ScoredGroup | TrainGroup:
        answer = task.answer(group.prompt) if task is not None else None
        async with one_at_a_time:
            scored = await asyncio.to_thread(score_group, scorer, group, worker_id, answer)
        if drop_uniform:
            await filter_uniform(bus, scored, worker_id)
        return TrainGroup(scored=scored) if to_train else scored

    return Worker(bus, "reward", handle, RolloutGroup, options)


async def filter_uniform(bus: Bus, scored: ScoredGroup, source: str) -> None:
    """Return when `scored` goes on to the trainer; raise `Skip` (ack, no output) when it is filtered.

    A uniform group is added to the filtered set first (the credit: idempotent, so a redelivery after a
    crash at any point below adds nothing), then announced; the event may come twice for one group, the
    credit never does. A group that is not uniform but whose release index is already in the set is a copy
    of a filtered group (scored again with other samples): it is skipped, so no group is both replaced and
    trained.
    """
    prompt = scored.prompt
    if is_uniform(scored.rewards):
        total = await record_filtered(bus.state, prompt.release_index)
        reward = scored.rewards[0] if scored.rewards else 0.0
        fields = {"group_id": prompt.group_id, "release_index": prompt.release_index, "reward": reward}
        event = RunEvent(run=bus.run, event="group_filtered", source=source, fields={**fields, "filtered": total})
        await bus.publish("events", event)
        log.info("group_filtered", **fields, filtered=total)
        raise Skip()
    if holds((await read_filtered(bus.state))[0], prompt.release_index):
        log.info("filtered_copy_skipped", group_id=prompt.group_id, release_index=prompt.release_index)
        raise Skip()

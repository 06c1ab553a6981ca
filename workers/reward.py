"""The reward role: scores every sample of a rollout group.

Rewards come from the run config (`rewards:`), or the task's default. User code is contained by the
scorer (timeout, exceptions become a zero reward with the error recorded), so one bad sample never
kills the worker. Output goes to `scored` when the reference role is in the chain, else straight to
`train`.
"""

from __future__ import annotations

import asyncio

from relax_bus.bus import Bus
from relax_bus.settings import RunConfig
from relax_bus.worker import Delivery, Worker, WorkerOptions
from schemas import RewardDetail, RolloutGroup, ScoredGroup, TrainGroup
from workers.rewards import RewardSpec, Scorer, default_rewards


def make_scorer(bus: Bus) -> Scorer:
    """The run's scorer: configured reward terms, or the task's default."""
    return make_scorer_from(bus.config)


def make_scorer_from(cfg: RunConfig) -> Scorer:
    """A scorer for a run config (also used to check the config before a run starts)."""
    specs = [
        RewardSpec(type=r.type, weight=r.weight, options=r.options, timeout_s=r.timeout_s) for r in cfg.rewards
    ] or default_rewards(cfg.task.type)
    return Scorer(specs)


def score_group(scorer: Scorer, group: RolloutGroup, worker_id: str = "") -> ScoredGroup:
    """Score each sample; failures are zero rewards with the error in the details."""
    rewards, details = [], []
    for sample in group.samples:
        reward, components, error = scorer.score(sample.text, group.prompt.answer, sample.finish_reason)
        rewards.append(reward)
        details.append(RewardDetail(components=components, error=error))
    return ScoredGroup(rollout=group, rewards=tuple(rewards), details=tuple(details), worker_id=worker_id)


def reward_worker(bus: Bus, options: WorkerOptions | None = None) -> Worker[RolloutGroup]:
    """A Worker running the reward handler on the run's rollouts."""
    scorer = make_scorer(bus)
    options = options or WorkerOptions(concurrency=4)
    to_train = bus.topology.role("reward").output == "train"
    one_at_a_time = asyncio.Lock()  # the scorer's user-code child serves one call at a time

    async def handle(group: RolloutGroup, delivery: Delivery) -> ScoredGroup | TrainGroup:
        async with one_at_a_time:
            scored = await asyncio.to_thread(score_group, scorer, group, options.worker_id)
        return TrainGroup(scored=scored) if to_train else scored

    return Worker(bus, "reward", handle, RolloutGroup, options)

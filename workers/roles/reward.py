"""The reward role: scores every sample of a rollout group.

Rewards come from the run config (`rewards:`), or the task's default; the answer each group is scored
against comes from the run's task, not from the message (`TrustedTask`). User code is contained by the
scorer (timeout, exceptions become a zero reward with the error recorded), so one bad sample never
kills the worker. What is scored is what the actor trains: each sample's text is decoded here from its
token ids with the run's tokenizer (`scored_text`), never taken from the message, so a rollout whose text
says one thing and whose ids another is scored by its ids (and the scored group carries that text on).
Output goes to `scored` when the reference role is in the chain, else straight to `train`.

With a judge (`judge:`, the `genrm` role before this one), each sample's reward is the weighted rule rewards plus
`judge.weight x` the judge's score (component `judge`); a sample the judge gave no verdict has an error and is left
out of training. Without `rewards` such a run's reward is the judge's alone (not the task's default rule), and
`judge.check`, a rule logged beside it, lands in each sample's `RewardDetail.checks`.

Dynamic sampling (`sampling.drop_uniform`): a group whose rewards are all equal has zero advantages, so it is
not published; it is recorded in the run's filtered set (`workers.roles.filtered_credit`, which returns its
credit to the feeder, once however often the group is redelivered), announced with a `group_filtered` event
and acked. A copy of a group already filtered (published again after a crash) is acked without output too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_bus.bus import Bus
from relax_bus.control import Reject, Skip
from relax_bus.errors import ConfigError
from relax_bus.log import get_logger
from relax_bus.worker import Delivery, Worker, WorkerOptions
from schemas import Judgement, PromptGroup, RewardDetail, RolloutGroup, RunEvent, Sample, ScoredGroup, TrainGroup
from workers.config import PipelineConfig, task_seed, task_spec
from workers.data.byte_text import BYTE_SOURCES, ByteDecoder
from workers.data.tasks import TaskItem, load_task, prompt_text
from workers.omni.media_refs import by_reference
from workers.rewards.scorer import Scorer, default_rewards
from workers.roles.feeder import released_item
from workers.roles.filtered_credit import holds, is_uniform, read_filtered, record_filtered
from workers.roles.serve import RoleContext, run_worker

log = get_logger(__name__)


def make_scorer(bus: Bus) -> Scorer | None:
    """The run's scorer: configured reward terms, or the task's default; None in a run whose judge is its only
    reward (a `judge` section and no `rewards`)."""
    cfg = bus.config
    if not cfg.rewards and cfg.judge is not None:
        return None
    return make_scorer_from(cfg)


def make_scorer_from(cfg: PipelineConfig) -> Scorer:
    """A scorer for a run config (also used to check the config before a run starts)."""
    return Scorer(list(cfg.rewards) or default_rewards(_task_name(cfg)))


@dataclass(frozen=True)
class Judged:
    """How the judge's verdicts join a sample's reward: its weight, and the rule logged beside it."""

    weight: float = 1.0
    check: Scorer | None = None
    """The `judge.check` reward (None: no check)."""
    check_label: str = "check"


def run_tokenizer(cfg: PipelineConfig, cache_dir: Path | None = None) -> Any:
    """The run's tokenizer, as the rollout decodes with it: for the models built on bytes, their decoding alone
    (no tokenizer library loaded in the reward role)."""
    if cfg.model.source.type in BYTE_SOURCES:
        return ByteDecoder()
    from workers.data.models import source_tokenizer  # torch and transformers: a real model's tokenizer

    return source_tokenizer(cfg.model.source, cache_dir, cfg.model.seed)


def scored_text(tokenizer: Any, sample: Sample) -> str:
    """The text the actor trains on: the sample's token ids decoded as the engines decode them."""
    return str(tokenizer.decode(sample.token_ids.to_values(), skip_special_tokens=True))


def _task_name(cfg: PipelineConfig) -> str:
    """The task name the items carry (a jsonl file may name its own), which picks the default reward."""
    options = cfg.task.options
    return str(getattr(options, "task", cfg.task.type))


async def serve(ctx: RoleContext) -> None:
    """`relax worker reward`: the run's task is loaded, so every group is scored against its own answer."""
    cfg = ctx.connected.config
    task = TrustedTask(load_task(task_spec(cfg.task)), task_seed(cfg.task))
    tokenizer = await asyncio.to_thread(run_tokenizer, cfg, ctx.cache)
    await run_worker(ctx, reward_worker(ctx.connected, task=task, tokenizer=tokenizer))


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
                ("columns", dict(item.columns), prompt.columns),
            )
            if ours != theirs
        ]
        if differs:
            raise Reject(
                f"group {prompt.group_id} (release {prompt.release_index}) does not match the task's release: "
                f"{', '.join(differs)} differ"
            )
        return item.answer


def score_group(
    scorer: Scorer | None,
    group: RolloutGroup,
    worker_id: str = "",
    answer: str | None = None,
    tokenizer: Any = None,
    episode_reward: str = "rule",
    judged: Judged | None = None,
) -> ScoredGroup:
    """Score each sample against `answer` (default: the one the message carries), with the prompt's text and its
    item's columns for the rewards that take them (a batched reward: once for the group's samples); failures are
    zero rewards with the error in the details. With `tokenizer`, the text scored is decoded from the token ids
    (`scored_text`), and a sample whose sent text differs carries the decoded one on. An episode is scored by
    its final answer and, as `episode_reward` (`agent.reward`) says, its environment reward. A group with the judge's
    verdicts adds `judged.weight x score` to each reward; a sample without a verdict gets an error (left out)."""
    rewards, details = [], []
    answer = group.prompt.answer if answer is None else answer
    samples = group.samples if tokenizer is None else tuple(_as_decoded(tokenizer, s) for s in group.samples)
    if samples != group.samples:
        differ = sum(a.text != b.text for a, b in zip(samples, group.samples, strict=True))
        log.warning("sample_text_replaced", group_id=group.group_id, samples=differ, source=group.worker_id)
        group = group.model_copy(update={"samples": samples})
    prompt, columns = prompt_text(group.prompt.parts), group.prompt.columns
    plain = [s for s in samples if s.episode is None]
    scores = iter(
        scorer.score_many([s.text for s in plain], answer, [s.finish_reason for s in plain], prompt, columns)
        if scorer is not None and plain
        else ()
    )
    for i, sample in enumerate(samples):
        if scorer is None:  # the judge's score is the whole reward
            reward, components, error = 0.0, {}, None
        elif sample.episode is None:
            reward, components, error = next(scores)
        else:
            reward, components, error = _score_episode(scorer, sample, answer, tokenizer, episode_reward)
        checks: dict[str, float] = {}
        if group.judgements is not None:
            reward, components, error = _with_verdict(reward, components, error, group.judgements[i], judged)
            if judged is not None and judged.check is not None:
                value, _, failed = judged.check.score(sample.text, answer, sample.finish_reason)
                checks = {} if failed is not None else {judged.check_label: value}
        rewards.append(reward)
        details.append(RewardDetail(components=components, error=error, checks=checks))
    return ScoredGroup(rollout=group, rewards=tuple(rewards), details=tuple(details), worker_id=worker_id)


def _with_verdict(
    reward: float, components: dict[str, float], error: str | None, verdict: Judgement, judged: Judged | None
) -> tuple[float, dict[str, float], str | None]:
    """A sample's (reward, components, error) with the judge's verdict added: `weight x score` as the component
    `judge`, or, without a verdict, no reward and the judge's error (the sample is left out, not scored 0)."""
    if error is not None:
        return reward, components, error
    if verdict.score is None:
        return 0.0, {}, f"judge: {verdict.error}"
    value = (judged.weight if judged is not None else 1.0) * verdict.score
    return reward + value, {**components, "judge": value}, None


def episode_answer(tokenizer: Any, sample: Sample) -> str:
    """An episode's final answer, from its token ids: its last run of trained tokens (the policy's last turn) when
    that turn answered (`ended == "answer"`), else empty. Read from the ids, as `scored_text` is."""
    if sample.episode is None or sample.episode.ended != "answer":
        return ""
    ids, trained = sample.token_ids.to_values(), sample.trained()
    start = len(trained)
    while start > 0 and trained[start - 1]:
        start -= 1
    text = tokenizer.decode(ids[start:], skip_special_tokens=True) if tokenizer is not None else sample.episode.answer
    return str(text)


def _score_episode(
    scorer: Scorer, sample: Sample, answer: str | None, tokenizer: Any, how: str
) -> tuple[float, dict[str, float], str | None]:
    """(reward, components, error) of an episode: its final answer through the run's rewards (`rule`), the
    environment's summed step rewards (`env`), or both (`sum`). An episode that did not answer scores its rule
    terms on an empty answer with finish reason `length`; one whose environment failed has no reward (an error:
    the trainer leaves it out)."""
    assert sample.episode is not None
    if sample.episode.ended in ("env_error", "env_lost"):  # no reward exists: excluded from training, counted
        return 0.0, {}, f"the episode's environment failed ({sample.episode.ended})"
    env = sample.episode.env_reward or 0.0
    if how == "env":
        return env, {"env": env}, None
    finish = "stop" if sample.episode.ended == "answer" else "length"
    reward, components, error = scorer.score(episode_answer(tokenizer, sample), answer, finish)
    if how == "sum":
        return reward + env, {**components, "env": env}, error
    return reward, components, error


def _as_decoded(tokenizer: Any, sample: Sample) -> Sample:
    text = scored_text(tokenizer, sample)
    return sample if text == sample.text else sample.model_copy(update={"text": text})


def reward_worker(
    bus: Bus, options: WorkerOptions | None = None, task: TrustedTask | None = None, tokenizer: Any = None
) -> Worker[RolloutGroup]:
    """A Worker running the reward handler on the run's rollouts; with `task`, each group's prompt is checked
    against the task's release and scored with the task's answer (the role always passes it). Samples are scored
    by the text of their token ids, decoded with `tokenizer` (default: the run's, `run_tokenizer`)."""
    scorer = make_scorer(bus)
    tokenizer = tokenizer if tokenizer is not None else run_tokenizer(bus.config)
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
    episode_reward = bus.config.agent.reward if bus.config.agent is not None else "rule"
    judge = bus.config.judge
    judged = None
    if judge is not None:
        check = Scorer([judge.check]) if judge.check is not None else None
        judged = Judged(judge.weight, check, judge.check.label if judge.check is not None else "check")

    async def handle(group: RolloutGroup, delivery: Delivery) -> ScoredGroup | TrainGroup:
        answer = task.answer(group.prompt) if task is not None else None
        async with one_at_a_time:
            scored = await asyncio.to_thread(
                score_group, scorer, group, worker_id, answer, tokenizer, episode_reward, judged
            )
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

"""The genrm role: a judge model's verdict on every sample of a rollout group (a generative reward model).

In the chain only in a run with a `judge` section: rollouts -> genrm -> judged -> reward. The judge reads text:
each sample's response is decoded from its token ids with the run's tokenizer (as the reward role scores it), the
prompt's text and the task's trusted answer fill `judge.template`, and the judge's own tokenizer renders that
(`workers.rewards.judge`). The verdicts travel on the group (`RolloutGroup.judgements`); the reward role adds
`judge.weight x score` to the rule rewards, and leaves a sample without a verdict out of training.

A group whose verdicts take longer than `judge.timeout_s`, or whose judge forward fails, gets an error judgement on
every sample (counted per step as `judge_error_rate`): the run goes on without those samples rather than scoring
them 0. A timed-out forward still finishes in its thread before the next group starts (one at a time).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from relax_bus.bus import Bus
from relax_bus.log import get_logger
from relax_bus.worker import Delivery, Worker, WorkerOptions
from schemas import Judgement, RolloutGroup
from workers.config import task_seed, task_spec
from workers.data.models import load_model, load_tokenizer, materialize
from workers.data.tasks import load_task, prompt_text
from workers.rewards.judge import Judge, judge_prompt
from workers.roles.reward import TrustedTask, run_tokenizer, scored_text
from workers.roles.serve import RoleContext, run_worker

log = get_logger(__name__)


async def serve(ctx: RoleContext) -> None:
    """`relax worker genrm`."""
    cfg = ctx.connected.config
    task = TrustedTask(load_task(task_spec(cfg.task)), task_seed(cfg.task))
    await run_worker(ctx, await genrm_worker(ctx.connected, ctx.cache, task))


async def load_judge(bus: Bus, cache_dir: Path) -> Judge:
    """The run's judge model, loaded once."""
    cfg = bus.config.judge
    if cfg is None:
        raise ValueError("the run has no judge section")
    model_dir = await asyncio.to_thread(materialize, cfg.source, cache_dir / "judge", cfg.seed)
    model = await asyncio.to_thread(load_model, model_dir)
    judge = Judge(model.eval(), await asyncio.to_thread(load_tokenizer, model_dir), cfg)
    log.info("judge_ready", model=str(model_dir), verdict=cfg.verdict)
    return judge


async def genrm_worker(
    bus: Bus, cache_dir: Path, task: TrustedTask | None = None, options: WorkerOptions | None = None
) -> Worker[RolloutGroup]:
    """A Worker that adds the judge's verdicts to the run's rollout groups; with `task`, the reference answer is the
    task's (the prompt checked against its release), else the message's."""
    judge = await load_judge(bus, cache_dir)
    tokenizer = await asyncio.to_thread(run_tokenizer, bus.config, cache_dir)
    timeout_s = judge.cfg.timeout_s

    def verdicts(group: RolloutGroup, reference: str | None) -> tuple[Judgement, ...]:
        question = prompt_text(group.prompt.parts)
        template = judge.cfg.template
        texts = [judge_prompt(template, question, scored_text(tokenizer, s), reference) for s in group.samples]
        return tuple(judge.judge(texts))

    async def handle(group: RolloutGroup, delivery: Delivery) -> RolloutGroup:
        reference = task.answer(group.prompt) if task is not None else group.prompt.answer
        try:
            found = await asyncio.wait_for(asyncio.to_thread(verdicts, group, reference), timeout_s)
        except TimeoutError:
            found = _failed(group, f"judge timeout after {timeout_s:g} s")
        except (RuntimeError, ValueError) as err:  # deliberate: an engine error is the samples' outcome, not a crash
            found = _failed(group, f"judge failed: {str(err)[:200]}")
        failed = sum(j.error is not None for j in found)
        if failed:
            log.warning("judge_errors", group_id=group.group_id, samples=failed, first=found[0].error)
        return group.model_copy(update={"judgements": found})

    return Worker(bus, "genrm", handle, RolloutGroup, options or WorkerOptions(concurrency=1))


def _failed(group: RolloutGroup, why: str) -> tuple[Judgement, ...]:
    return tuple(Judgement(error=why) for _ in group.samples)

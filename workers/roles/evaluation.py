"""Held-out evaluation inside a rollout worker: once per block of `eval.every` policy versions, between batches.

After each engine call, the worker asks whether the version it holds opens a block of `eval.every` versions that no
worker has evaluated yet (`due`). The run state's counter `eval.claimed` (blocks claimed so far) is moved forward by
compare-and-set, so of several workers exactly one wins each block, and a block never goes back. The winner answers
every held-out item greedily (nucleus of one token) and `eval.samples` times at `eval.temperature`, scores the answers
with the run's rewards (`workers.rewards.scorer`) and publishes one `eval` run event (`workers.metrics.evaluation`).
The answers go nowhere else: nothing of the held-out set reaches the trainer. A worker that dies between its claim
and its event loses that block's evaluation (the next block is evaluated as usual); the metrics role's sinks keep
each evaluated version once (`eval/version`), so an event delivered again is never counted twice.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from relax_bus.bus import Bus
from relax_bus.errors import CasConflict
from relax_bus.log import get_logger
from relax_bus.run_state import RunState
from schemas import RunEvent
from workers.config import EvalConfig, PipelineConfig
from workers.data.prompts import prompt_ids
from workers.data.task_items import TaskItem
from workers.data.tasks import prompt_text
from workers.engines.base import Engine, SamplingSettings
from workers.metrics.evaluation import EVAL_EVENT, VERSION, eval_values
from workers.rewards.scorer import Scorer, default_rewards
from workers.state_keys import EVAL_CLAIMED

log = get_logger(__name__)

GREEDY_TOP_P = 1e-9
"""The nucleus of a greedy answer: the most likely token alone (`workers.engines.token_draw`, vLLM alike)."""


def eval_block(version: int, every: int) -> int:
    """The block of policy versions `version` is in: `version // every` (v0-v9 are block 0 for every=10)."""
    return version // every


async def claim_block(state: RunState, block: int) -> tuple[bool, int]:
    """Claim the evaluation of `block` by moving `eval.claimed` (blocks claimed so far) to `block + 1` with a
    compare-and-set. Returns whether this caller won it, and the last block now known to be claimed (by anyone).

    A block at or below one claimed already is never claimed again; of several callers racing for a block, the
    compare-and-set lets exactly one win."""
    claimed, revision = await state.count(EVAL_CLAIMED)
    if claimed > block:
        return False, claimed - 1
    try:
        await state.cas(EVAL_CLAIMED, block + 1, revision)
    except CasConflict:  # deliberate: another worker moved it first; this block (or a later one) is theirs
        return False, block
    return True, block


def eval_items(config: EvalConfig) -> list[TaskItem]:
    """The held-out items (`eval.dataset`, the first `eval.max_items`)."""
    from workers.config import task_spec
    from workers.data.tasks import load_task

    return load_task(task_spec(config.dataset))[: config.max_items]


class Evaluator:
    """One rollout worker's share of the held-out evaluation: claim a block, answer, score, publish."""

    def __init__(self, bus: Bus, engine: Engine, tokenizer: Any, worker_id: str) -> None:
        cfg: PipelineConfig = bus.config
        assert cfg.eval is not None
        self.bus = bus
        self.engine = engine
        self.config = cfg.eval
        self.worker_id = worker_id
        self.items = eval_items(cfg.eval)
        model = cfg.model
        self.ids = [
            prompt_ids(tokenizer, prompt_text(i.parts), model.prompt_format, model.system_prompt, i.history)
            for i in self.items
        ]
        task = str(getattr(cfg.eval.dataset.options, "task", cfg.eval.dataset.type))
        self.scorer = Scorer(list(cfg.rewards) or default_rewards(task))
        new_tokens = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
        self.greedy = SamplingSettings(temperature=1.0, top_p=GREEDY_TOP_P, max_new_tokens=new_tokens)
        self.sampled = SamplingSettings(
            temperature=cfg.eval.temperature, top_p=cfg.eval.top_p, max_new_tokens=new_tokens
        )
        self.seen = -1
        """The last block this worker found claimed (by itself or another): nothing at or below it is asked again."""

    def close(self) -> None:
        self.scorer.close()

    async def after_batch(self) -> None:
        """Evaluate the held version if it opens a block nobody has claimed (called between engine calls)."""
        version = self.engine.version
        if version < 0 or eval_block(version, self.config.every) <= self.seen:
            return
        won, self.seen = await claim_block(self.bus.run_state, eval_block(version, self.config.every))
        if won:
            await self.evaluate(version)

    async def evaluate(self, version: int) -> dict[str, float]:
        """Answer, score and publish the held-out set under the weights of `version` (the engine's)."""
        started = time.perf_counter()
        n, k = len(self.items), self.config.samples
        greedy = await asyncio.to_thread(self.engine.generate, self.ids, 1, self.greedy, list(range(n)))
        seeds = [self.config.seed + i * k for i in range(n)]
        sampled = await asyncio.to_thread(self.engine.generate, self.ids, k, self.sampled, seeds)

        def rewards(answers: list[Any], item: TaskItem) -> list[float]:
            return [self.scorer.score(a.text, item.answer, a.finish_reason).reward for a in answers]

        def values_of() -> dict[str, float]:  # a sandboxed reward blocks: in a thread
            greedy_r = [rewards(g, item)[0] for g, item in zip(greedy, self.items, strict=True)]
            sampled_r = [rewards(s, item) for s, item in zip(sampled, self.items, strict=True)]
            return eval_values(greedy_r, sampled_r, self.config.correct_at)

        values = await asyncio.to_thread(values_of)
        fields: dict[str, float | int] = {**values, VERSION: version}
        fields["eval/seconds"] = round(time.perf_counter() - started, 3)
        event = RunEvent(run=self.bus.run, event=EVAL_EVENT, source=self.worker_id, fields=fields)
        await self.bus.publish("events", event)
        log.info("eval_done", version=version, **{k.removeprefix("eval/"): v for k, v in values.items()})
        return values

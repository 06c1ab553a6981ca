"""The demo task without the bus: one process generates, scores, trains and loads, and the reward a set of
weights earns when it is measured directly (the modes, algorithms, R3 and bus-overhead benchmarks share these).

A run's metrics give, at step k, the reward of the groups trained at step k: samples of the weights of
version k - lag. With large lags (unbounded staleness) that is the reward of an old policy, not of the
weights the run ends with; `evaluate` measures the latter: every task item, `n` samples each, with fixed
per-prompt seeds, so two policies are compared on the same random draws.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from schemas import PromptGroup, RolloutGroup, TrainGroup, WireTensor
from workers.config import PipelineConfig, task_spec
from workers.data.models import materialize
from workers.data.prompts import prompt_ids
from workers.data.tasks import load_task, prompt_text
from workers.engines.base import SamplingSettings
from workers.engines.torch_engine import TorchEngine
from workers.roles.feeder import group_for
from workers.roles.reward import make_scorer_from, score_group
from workers.roles.rollout import sample_of
from workers.training.trainer import PolicyTrainer
from workers.training.warmup import run_warmup

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.yaml"


def warm_start(base: PipelineConfig, work: Path) -> tuple[Path, dict[str, float]]:
    """Run the demo's supervised warm-up once and save the weights it leaves as a model directory."""
    torch.set_num_threads(1)  # as the actor does it (two threads stall on a shared two-core machine)
    model_dir = materialize(base.model.source, work / "base", base.model.seed)
    trainer = PolicyTrainer(model_dir, base)
    info = run_warmup(trainer, load_task(task_spec(base.task)))
    warm = work / "warm"
    trainer.model.save_pretrained(warm, safe_serialization=True)
    trainer.tokenizer.save_pretrained(warm)
    return warm, info


class Colocated:
    """Generate, score, train, load: one process, no bus."""

    def __init__(self, config: PipelineConfig, model_dir: Path) -> None:
        self.config = config
        self.engine = TorchEngine(model_dir, record_routing=config.trainer.moe.routing_replay == "r3")
        self.trainer = PolicyTrainer(model_dir, config)
        self.scorer = make_scorer_from(config)
        self.items = load_task(task_spec(config.task))
        r = config.rollout
        self.sampling = SamplingSettings(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens)
        self.released = 0

    def step(self, version: int) -> dict[str, float]:
        cfg, tok = self.config, self.trainer.tokenizer
        prompts = [self._prompt(self.released + i, version) for i in range(cfg.groups_per_step)]
        self.released += len(prompts)
        m = cfg.model
        ids = [prompt_ids(tok, prompt_text(p.parts), m.prompt_format, m.system_prompt) for p in prompts]
        t0 = time.perf_counter()
        outputs = self.engine.generate(ids, cfg.samples_per_group, self.sampling)
        t1 = time.perf_counter()
        groups = [
            TrainGroup(scored=score_group(self.scorer, rollout_group(p, i, out, version)))
            for p, i, out in zip(prompts, ids, outputs, strict=True)
        ]
        t2 = time.perf_counter()
        metrics = self.trainer.step(groups)
        t3 = time.perf_counter()
        self.engine.load_state_dict(self.trainer.full_state(), version + 1)
        t4 = time.perf_counter()
        return {
            "reward_mean": metrics["reward_mean"],
            "gen_s": t1 - t0,
            "score_s": t2 - t1,
            "train_s": t3 - t2,
            "sync_s": t4 - t3,
            "step_s": t4 - t0,
        }

    def _prompt(self, index: int, version: int) -> PromptGroup:
        return group_for("colocated", self.config.samples_per_group, self.items, index, version)

    def close(self) -> None:
        self.scorer.close()


def rollout_group(prompt: PromptGroup, ids: list[int], samples: list[Any], version: int) -> RolloutGroup:
    return RolloutGroup(
        prompt=prompt,
        prompt_token_ids=WireTensor.from_values(ids, "int32"),
        samples=tuple(sample_of(g) for g in samples),
        policy_version=version,
    )


def run_colocated(
    config: PipelineConfig, warm: Path, steps: int, threads: int
) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """`steps` colocated steps from the weights in `warm`: one row per step, and the weights it ends with."""
    torch.set_num_threads(threads)
    colocated = Colocated(config, warm)
    rows = []
    try:
        for step in range(1, steps + 1):
            rows.append({"step": float(step), **colocated.step(step - 1), "at": time.time()})
        final = colocated.trainer.full_state()
    finally:
        colocated.close()
    return rows, final


def phase_times(config: PipelineConfig, warm: Path, steps: int, threads: int) -> dict[str, float]:
    """Median generate and train seconds of a demo step with `threads` torch threads (fresh weights)."""
    rows = run_colocated(config, warm, steps + 1, threads)[0][1:]  # the first call pays one-off set-up costs
    return {key: statistics.median(r[key] for r in rows) for key in ("gen_s", "score_s", "train_s", "sync_s")}


def moving_average(values: list[float], window: int = 5) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def evaluate(
    config: PipelineConfig, model_dir: Path, state: dict[str, torch.Tensor], n: int = 16, seed: int = 9_000
) -> float:
    """Mean reward of `state` over every task item, n samples each at the run's sampling settings; prompt i's
    samples draw from generators seeded seed + i*n + j, the same for every policy evaluated."""
    engine = TorchEngine(model_dir)
    engine.load_state_dict(state, 0)
    scorer = make_scorer_from(config)
    items = load_task(task_spec(config.task))
    m, r = config.model, config.rollout
    sampling = SamplingSettings(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens)
    try:
        prompts = [group_for("eval", n, items, i, 0) for i in range(len(items))]
        ids = [prompt_ids(engine.tokenizer, prompt_text(p.parts), m.prompt_format, m.system_prompt) for p in prompts]
        outputs = engine.generate(ids, n, sampling, seeds=[seed + i * n for i in range(len(ids))])
        rewards = [
            reward
            for p, i, out in zip(prompts, ids, outputs, strict=True)
            for reward in score_group(scorer, rollout_group(p, i, out, 0)).rewards
        ]
    finally:
        scorer.close()
    return statistics.fmean(rewards)

"""SimulatedTrainer: the policy trainer with its optimizer update replaced by a timed sleep.

Selected by `trainer.simulate` (`benchmarks/cluster_sim.py`, `benchmarks/scale.py`). Everything
around the update is the real `PolicyTrainer`: the model it holds (so weight publishing, checkpoints
and restores move real tensors), the warm-up, and the state in and out. A step sleeps for
`step_s * LogNormal(0, sigma)` seconds and reports the batch's reward statistics; the loss terms
are reported as those of an update that changed nothing (loss 0, ratios and importance weights 1).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from schemas import TrainGroup
from workers.config import PipelineConfig as RunConfig
from workers.training.trainer import PolicyTrainer


class SimulatedTrainer(PolicyTrainer):
    """A PolicyTrainer whose `step` sleeps instead of updating the model."""

    def __init__(self, model_dir: Path, config: RunConfig) -> None:
        super().__init__(model_dir, config)
        sim = config.trainer.simulate
        if sim is None:
            raise ValueError("SimulatedTrainer needs trainer.simulate in the run config")
        self.sim = sim
        self.rng = random.Random(sim.seed)

    def step(
        self, groups: Sequence[TrainGroup], version: int | None = None, media: Sequence[object] = ()
    ) -> dict[str, float]:
        """Sleep for one drawn step time; return the metrics a real step reports (`media` is not looked at)."""
        started = time.perf_counter()
        seconds = self.sim.step_s * (self.rng.lognormvariate(0.0, self.sim.sigma) if self.sim.sigma else 1.0)
        time.sleep(seconds)
        rewards = [r for g in groups for r in g.scored.rewards]
        tokens = sum(s.token_ids.numel for g in groups for s in g.scored.rollout.samples)
        return {
            "loss": 0.0,
            "kl": 0.0,
            "grad_norm": 0.0,
            "reward_mean": statistics.fmean(rewards) if rewards else math.nan,
            "reward_std": statistics.pstdev(rewards) if rewards else math.nan,
            "response_tokens": float(tokens),
            "train_s": time.perf_counter() - started,
            "ppo_clip_frac": 0.0,
            "tis_mean": 1.0,
            "tis_max": 1.0,
            "tis_clip_frac": 0.0,
            "tis_masked_frac": 0.0,
            "ratio_mean": 1.0,
            "logprob_mismatch": 0.0,
        }

"""The teacher section: on-policy distillation from a teacher model (the `teacher` role; docs/algorithms.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from workers.config.base import Section
from workers.config.model_source import ModelSource


class TeacherConfig(Section):
    """A teacher model that scores every token the student sampled; its log-prob minus the sampling policy's is a
    per-token advantage (reverse KL), alone or beside the reward's advantage."""

    source: ModelSource
    """The teacher's weights, as `model.source` takes them: a model directory (one `relax model warmup` or
    `relax export` wrote, or a Hugging Face one) or `hf:<repo>`. Its tokenizer must be the policy's: same vocabulary,
    special ids and chat template (checked when a role starts, refused with one line otherwise)."""
    seed: int = 0
    """Seed of the initial weights when the source is a model built in code."""
    coef: float = Field(default=1.0, gt=0)
    """Weight of the teacher's per-token advantage, log p_teacher(y_t) - log p_sampling(y_t)."""
    reward_coef: float = Field(default=0.0, ge=0)
    """Weight of the reward's advantage beside it: 0 distills only (the rewards are still computed and logged), 1
    adds the teacher's term to the reward's advantage."""
    baseline: Literal["group", "none"] = "group"
    """Baseline subtracted from the teacher's per-token term: `group`, the mean of that term over the group's other
    samples at the same position (unbiased, far less noisy; `workers.training.distill`); `none`, plain per-token
    REINFORCE on it."""

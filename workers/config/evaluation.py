"""The held-out evaluation section: a set the policy never trains on, scored every few policy versions."""

from __future__ import annotations

from pydantic import Field

from workers.config.base import Section
from workers.config.tasks import TaskConfig


class EvalConfig(Section):
    """Held-out evaluation by a rollout worker between its batches (`workers.roles.evaluation`): greedy and sampled
    answers to every item, scored with the run's rewards, logged as `eval/*`; nothing of it is trained on."""

    dataset: TaskConfig
    """The held-out items: a task section of the training task's type that shares no item with it (the demo's
    addition: the same shuffle with `offset` past the training task's `limit`)."""
    every: int = Field(default=10, ge=1)
    """Evaluate once per block of this many policy versions (v0-v9, v10-v19, ...): the first rollout worker to hold
    a version of a block evaluates it, exactly once however many workers run."""
    samples: int = Field(default=4, ge=1, le=64)
    """Sampled answers per item: k of pass@k, `eval/pass_at_k` (an item counts when any of its k answers is
    correct)."""
    temperature: float = Field(default=1.0, gt=0)
    """Temperature of the sampled answers (the greedy answer takes the most likely token at each position)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus of the sampled answers."""
    max_new_tokens: int | None = Field(default=None, ge=1)
    """Longest answer; null: `rollout.max_new_tokens`."""
    max_items: int | None = Field(default=None, ge=1)
    """Evaluate only the first `max_items` items of the dataset (null: all of them)."""
    correct_at: float = 1.0
    """A reward at or above this counts as a correct answer (accuracy and pass@k)."""
    seed: int = 0
    """Seed of the sampled answers: item i, sample j is drawn from the stream `seed + i * samples + j`."""

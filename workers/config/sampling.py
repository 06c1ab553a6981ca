"""Dynamic sampling: which scored groups are worth training, and how far the feeder may over-sample for them."""

from __future__ import annotations

from pydantic import Field

from workers.config.base import Section


class SamplingConfig(Section):
    """Dynamic sampling: groups whose samples all got the same reward carry no learning signal (their GRPO
    advantages are exactly zero); the reward role can drop them and the feeder release replacements."""

    drop_uniform: bool = False
    """Drop a scored group whose rewards are all equal before it reaches the trainer (a `group_filtered`
    event); the feeder releases a replacement, so every step still trains `groups_per_step` informative
    groups. Needs `samples_per_group` of 2 or more."""
    max_oversample: float = Field(default=2.0, ge=1.0, le=1000.0, allow_inf_nan=False)
    """Most groups the feeder releases per group the run trains (replacements of stale and dead-lettered
    groups aside): at most `(max_oversample - 1) x trainer.steps x groups_per_step` filtered groups are
    replaced. One more filtered group and the run cannot finish within the bound: the feeder emits
    `oversample_exhausted` and fails. 1.0 replaces none."""

"""The critic section: a value model for PPO with GAE (the `critic` role; docs/algorithms.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from workers.config.base import Section


class CriticConfig(Section):
    """A value model with its own optimizer, checkpoints and versions: it gives every sampled token a value V(s_t),
    the actor's `gae` advantage turns rewards and values into per-token advantages, and the critic trains on the
    GAE returns with PPO's clipped value loss."""

    source: Literal["policy"] = "policy"
    """Where the value model starts: `policy` is the policy's version 0 (the actor's weights after its warm-up) with
    a scalar value head (initialised to 0) on its last hidden state."""
    lr: float = Field(default=1.0e-3, gt=0)
    """AdamW learning rate of the value model."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay of the value model."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient-norm clip of each value update."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """GAE's discount: delta_t = r_t + gamma V_{t+1} - V_t."""
    lam: float = Field(default=0.95, ge=0, le=1)
    """GAE's lambda: A_t = sum_k (gamma lam)^k delta_{t+k}; 1 is the Monte-Carlo return, 0 one-step TD."""
    value_clip: float = Field(default=0.2, gt=0)
    """PPO's value clip: a new value counts at most this far from the value the group was sent with."""
    updates: int = Field(default=1, ge=1)
    """Value-loss updates on each group (the clip binds from the second on)."""
    checkpoint_every: int = Field(default=16, ge=1)
    """Groups between checkpoints; a group is acknowledged only once a checkpoint holds its update, so a restart
    trains every group exactly once."""
    idle_checkpoint_s: float = Field(default=10.0, gt=0)
    """Seconds without a new group after which the groups held are checkpointed (and acknowledged) short of
    `checkpoint_every`: the run's last groups, and a pipeline waiting on a dead letter's replacement, need it."""
    keep: int = Field(default=2, ge=1)
    """Checkpoints kept (the newest ones)."""

"""The trainer's optimizer and learning-rate schedule.

AdamW with two parameter groups: weight decay on matrices (linear and embedding weights), none on
vectors (norm scales and biases), as is usual for transformers. The schedule is a multiplier of the
base lr per optimizer update u (0-based), with W warm-up updates and U updates in the run:

    warm-up     u < W:  (u + 1) / W
    constant            1
    linear              m + (1 - m) * (1 - p)                   p = (u - W) / max(1, U - W), m = min_lr_ratio
    cosine              m + (1 - m) * (1 + cos(pi * p)) / 2
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

SCHEDULES = ("constant", "linear", "cosine")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Decayed (ndim >= 2) and not decayed (ndim < 2: norms, biases) trainable parameters."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    plain = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over `param_groups` (no decay on norms and biases)."""
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr)


def lr_multiplier(schedule: str, warmup: int, total: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """The schedule's multiplier of the base lr as a function of the 0-based update index."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: {list(SCHEDULES)}")

    def multiplier(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (update - warmup) / max(1, total - warmup))
        shape = 1.0 - progress if schedule == "linear" else (1.0 + math.cos(math.pi * progress)) / 2
        return min_ratio + (1.0 - min_ratio) * shape

    return multiplier


def make_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, warmup: int, total: int, min_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying `lr_multiplier`; step it once after every optimizer update."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(schedule, warmup, total, min_ratio))

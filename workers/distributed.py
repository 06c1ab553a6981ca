"""The trainer across torchrun ranks: rank 0 talks to the bus and drives, the other ranks mirror.

Under FSDP2 every trainer call that touches the model (a step, gathering the full state dict, a
checkpoint, a restore) is a collective, so all ranks must make the same calls in the same order.
Rank 0 wraps its `PolicyTrainer` in `DrivenTrainer`, which broadcasts each call (name and arguments)
before making it; ranks > 0 run `follow`, which receives and repeats them until told to stop.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from relax_bus.log import get_logger
from workers.trainer import PolicyTrainer

log = get_logger(__name__)

MIRRORED = frozenset({"step", "warmup", "full_state", "checkpoint_bytes", "restore", "load_full"})


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside torchrun."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DrivenTrainer:
    """Rank 0's trainer: the same interface as PolicyTrainer, every model call mirrored on all ranks."""

    def __init__(self, trainer: PolicyTrainer) -> None:
        self.trainer = trainer

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.trainer, name)
        if name not in MIRRORED:
            return target

        def mirrored(*args: Any) -> Any:
            dist.broadcast_object_list([(name, args)], src=0)
            return target(*args)

        return mirrored

    def stop(self) -> None:
        """Release the followers."""
        dist.broadcast_object_list([("stop", ())], src=0)


def follow(trainer: PolicyTrainer) -> None:
    """Ranks > 0: repeat rank 0's trainer calls until it says stop."""
    rank, size = world()
    log.info("follower_ready", rank=rank, world=size)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        name, args = box[0]
        if name == "stop":
            return
        if name not in MIRRORED:
            raise RuntimeError(f"rank 0 asked for {name!r}, which is not a mirrored trainer call")
        getattr(trainer, name)(*args)

"""The trainer across torchrun ranks: rank 0 talks to the bus and drives, the other ranks mirror.

Under FSDP2 every trainer call that touches the model (a step, gathering the full state dict, a
checkpoint, a restore) is a collective, so all ranks must make the same calls in the same order.
Rank 0 wraps its `PolicyTrainer` in `DrivenTrainer`, which broadcasts each call (name and arguments)
before making it; ranks > 0 run `follow`, which receives and repeats them until told to stop. The mirrored
calls are the trainer's own (`step`, `full_state`, `adapter_state`, `load_full`), its checkpoints'
(`checkpoints.<call>`, `workers.checkpoints.trainer_state`) and the supervised warm-up (`warm_up`,
`workers.training.warmup`).

On several nodes (`trainer.distributed.nnodes` > 1) nothing changes but the world: torchrun's c10d rendezvous
numbers the nodes, RANK is global (the one rank 0 of all nodes drives, wherever it landed) and
LOCAL_RANK numbers the ranks of one node (it picks the GPU: `workers.training.devices`). On several
nodes every rank checks that the world torchrun built is the config's
`trainer.distributed.nnodes x trainer.distributed.nproc` before the first mirrored call, so nodes started by
hand with other torchrun flags fail with a config error.
The process group keeps torch's default timeouts (a collective waits 30 minutes under gloo, 10 under
nccl). A follower waits in its broadcast, a gloo collective on GPUs too (the objects are on the CPU),
while rank 0 waits for train groups: a trainer starved of groups for 30 minutes fails on every rank,
and the restarted actor resumes from its checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from relax_bus.errors import ConfigError
from relax_bus.log import get_logger
from workers.training.trainer import PolicyTrainer

if TYPE_CHECKING:
    from workers.data.tasks import TaskItem

log = get_logger(__name__)

CHECKPOINTS = "checkpoints."
"""The prefix of a mirrored call of the trainer's checkpoints."""


def _checkpoint_call(name: str) -> Callable[..., Any]:
    return lambda trainer, *args: getattr(trainer.checkpoints, name)(*args)


MIRRORED: dict[str, Callable[..., Any]] = {
    "step": lambda trainer, *args: trainer.step(*args),
    "full_state": lambda trainer: trainer.full_state(),
    "adapter_state": lambda trainer: trainer.adapter_state(),
    "load_full": lambda trainer, state: trainer.load_full(state),
    "warmup": lambda trainer, items: _run_warmup(trainer, items),
    **{
        CHECKPOINTS + name: _checkpoint_call(name)
        for name in ("to_bytes", "state", "restore", "save_sharded", "restore_sharded", "restore_recorded")
    },
}
"""Every call that touches the model, by the name rank 0 broadcasts: what each rank does with its trainer."""


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside torchrun."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_world(trainer: PolicyTrainer) -> None:
    """ConfigError when a trainer configured for several nodes is not in a world of `trainer.distributed.nnodes x
    trainer.distributed.nproc` ranks (on one node `nproc` only tells `relax run` how many ranks to start)."""
    shape = trainer.config.trainer.distributed
    rank, size = world()
    if shape.nnodes > 1 and size != shape.world_size:
        raise ConfigError(
            "trainer",
            [
                f"rank {rank} is in a world of {size} ranks, but trainer.distributed.nnodes x "
                f"trainer.distributed.nproc is {shape.nnodes} x {shape.nproc} = {shape.world_size}: start every node "
                f"with --nnodes={shape.nnodes} --nproc-per-node={shape.nproc}"
            ],
        )


class DrivenTrainer:
    """Rank 0's trainer: the same interface as PolicyTrainer, every model call mirrored on all ranks."""

    def __init__(self, trainer: PolicyTrainer) -> None:
        check_world(trainer)
        self.trainer = trainer
        rank, size = world()
        log.info("driver_ready", rank=rank, world=size, local_rank=dist.get_node_local_rank(fallback_rank=0))

    def __getattr__(self, name: str) -> Any:
        if name not in MIRRORED:
            return getattr(self.trainer, name)
        return lambda *args: self.mirror(name, *args)

    @property
    def checkpoints(self) -> MirroredCheckpoints:
        """The trainer's checkpoints, every call mirrored on all ranks."""
        return MirroredCheckpoints(self)

    def mirror(self, name: str, *args: Any) -> Any:
        """The call `name` (a key of MIRRORED) on every rank: broadcast it, then make it here."""
        dist.broadcast_object_list([(name, args)], src=0)
        return MIRRORED[name](self.trainer, *args)

    def stop(self) -> None:
        """Release the followers, then leave the process group with them."""
        dist.broadcast_object_list([("stop", ())], src=0)
        leave()


class MirroredCheckpoints:
    """Rank 0's `TrainerCheckpoints`: every call mirrored on all ranks."""

    def __init__(self, driven: DrivenTrainer) -> None:
        self.driven = driven

    def __getattr__(self, name: str) -> Any:
        if CHECKPOINTS + name not in MIRRORED:
            return getattr(self.driven.trainer.checkpoints, name)
        return lambda *args: self.driven.mirror(CHECKPOINTS + name, *args)


def warm_up(
    trainer: PolicyTrainer | DrivenTrainer,
    items: Sequence[TaskItem],
    on_check: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """The supervised warm-up (`workers.training.warmup.run_warmup`), on every rank when `trainer` drives several
    (`on_check`, told each accuracy check, only in one process)."""
    if isinstance(trainer, DrivenTrainer):
        info: dict[str, float] = trainer.mirror("warmup", items)
        return info
    return _run_warmup(trainer, items, on_check)


def _run_warmup(
    trainer: PolicyTrainer, items: Sequence[TaskItem], on_check: Callable[[dict[str, float]], None] | None = None
) -> dict[str, float]:
    # Imported when a warm-up runs: its task and media modules pull in the NATS client, which a rank that only
    # mirrors steps never needs.
    from workers.training.warmup import run_warmup

    return run_warmup(trainer, items, on_check)


def leave() -> None:
    """Every rank, at the end: meet at a barrier, then destroy the process group. A rank that exits with the
    group still up tears gloo's threads down in the interpreter's finalisation, which can abort the process
    ("terminate called without an active exception", SIGABRT) when another rank is still in a collective."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def follow(trainer: PolicyTrainer) -> None:
    """Ranks > 0: repeat rank 0's trainer calls until it says stop."""
    check_world(trainer)
    rank, size = world()
    log.info("follower_ready", rank=rank, world=size, local_rank=dist.get_node_local_rank(fallback_rank=0))
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        name, args = box[0]
        if name == "stop":
            trainer.checkpoints.wait()  # this rank's part of the last sharded checkpoint is written
            leave()
            return
        if name not in MIRRORED:
            raise RuntimeError(f"rank 0 asked for {name!r}, which is not a mirrored trainer call")
        MIRRORED[name](trainer, *args)

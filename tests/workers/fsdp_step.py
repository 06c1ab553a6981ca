"""Run by test_fsdp under torchrun: one FSDP2 training step driven from rank 0, full state saved by rank 0; with a third
argument, supervised rows of that JSONL file mixed in (`trainer.sft`)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.workers.test_fsdp import batch_groups, config
from workers.training.devices import init_distributed
from workers.training.distributed import DrivenTrainer, follow, world
from workers.training.trainer import PolicyTrainer


def main(model_dir: str, out: str, sft: str | None = None) -> None:
    torch.set_num_threads(1)
    init_distributed()
    rank, size = world()
    assert size == 2, size
    trainer = PolicyTrainer(Path(model_dir), config(sft))
    if rank == 0:
        driven = DrivenTrainer(trainer)
        metrics = driven.step(batch_groups())
        state = driven.full_state()
        driven.stop()
        torch.save({"state": state, "metrics": metrics}, out)
    else:
        follow(trainer)


if __name__ == "__main__":
    main(*sys.argv[1:])

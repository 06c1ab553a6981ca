"""Run by test_fsdp under torchrun: one FSDP2 training step driven from rank 0, full state saved by rank 0; with a third
argument, supervised rows of that JSONL file mixed in (`trainer.sft`); with a fourth (`lora`), a LoRA adapter trained
(`trainer.lora`), its B started from seed 1 as the one-process trainer's."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.workers.test_fsdp import batch_groups, config
from workers.training.devices import init_distributed
from workers.training.distributed import DrivenTrainer, follow, world
from workers.training.ranks import Fsdp2Ranks
from workers.training.trainer import PolicyTrainer


def main(model_dir: str, out: str, sft: str = "", lora: str = "") -> None:
    torch.set_num_threads(1)
    init_distributed()
    rank, size = world()
    assert size == 2, size
    if lora:  # B drawn on the full model, before the trainer shards it (the same draws as in one process)
        trainer = lora_trainer(Path(model_dir), sft or None)
    else:
        trainer = PolicyTrainer(Path(model_dir), config(sft or None))
    if rank == 0:
        driven = DrivenTrainer(trainer)
        metrics = driven.step(batch_groups())
        state = driven.full_state()
        driven.stop()
        torch.save({"state": state, "metrics": metrics}, out)
    else:
        follow(trainer)


def lora_trainer(model_dir: Path, sft: str | None) -> PolicyTrainer:
    """A LoRA trainer whose adapter's B is drawn from seed 1 before FSDP2 shards the model."""
    shard = Fsdp2Ranks.shard

    def drawn_then_sharded(self: Fsdp2Ranks, model: torch.nn.Module) -> None:
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.data.normal_(0, 0.1)
        shard(self, model)

    Fsdp2Ranks.shard = drawn_then_sharded  # type: ignore[method-assign]
    return PolicyTrainer(model_dir, config(sft, lora=True))


if __name__ == "__main__":
    main(*sys.argv[1:])

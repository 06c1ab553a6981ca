"""The trainer's checkpoints: its model, optimizer and lr schedule, with the caller's `extra`, out and back in.

Two forms, both read without running code on any world size:

    whole     gathered on rank 0 into tensors of their own, written as torch.save bytes (`workers.checkpoints.whole`)
    sharded   every rank's shards written in the background into one directory (`workers.checkpoints.sharded`)

Every call is a collective under FSDP2: all ranks make it, in the same order (`workers.training.distributed`
mirrors rank 0's calls).
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from workers.checkpoints.sharded import ShardedCheckpoints
from workers.checkpoints.whole import load_whole, whole_state, write_checkpoint


class TrainerCheckpoints:
    """One rank's checkpoints of a trainer's model, optimizer and lr schedule."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        rank: int,
        world: int,
        base: str | None = None,
    ) -> None:
        self.base = base
        """A LoRA trainer's base digest: whole checkpoints then hold the adapter (and its optimizer state) and this
        digest, not the frozen base; a restore refuses one of another base."""
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.rank = rank
        self.world = world
        self.sharded = ShardedCheckpoints(rank, world)

    def to_bytes(self, extra: dict[str, Any]) -> bytes:
        """Model, optimizer, lr schedule and `extra` as torch.save bytes (a collective)."""
        return self.serialize(self.state(extra))

    def state(self, extra: dict[str, Any]) -> dict[str, Any]:
        """Model, optimizer, lr schedule and `extra` as they are now, in tensors of their own (a collective; rank 0
        gets the tensors): the next step may train while `serialize` writes this out."""
        return whole_state(self.model, self.optimizer, self.scheduler, extra, self.base)

    def serialize(self, state: dict[str, Any]) -> bytes:
        """`state`'s result as torch.save bytes (tensors, containers and numbers only); b"" on ranks > 0."""
        return write_checkpoint(state) if self.rank == 0 else b""

    def restore(self, data: bytes) -> dict[str, Any]:
        """Load a checkpoint written by `to_bytes`; return its `extra` (ranks > 0 may pass b"")."""
        return load_whole(data, self.model, self.optimizer, self.scheduler, self.world, self.base)

    def save_sharded(self, path: str, extra: dict[str, Any]) -> Future[Any]:
        """Start a sharded checkpoint into directory `path` (a collective); the future resolves once every rank's
        shards are written."""
        return self.sharded.save(Path(path), self.model, self.optimizer, self.scheduler, extra)

    def restore_sharded(self, path: str) -> dict[str, Any]:
        """Load the sharded checkpoint in `path` on this world size (a collective); return its `extra`."""
        return self.sharded.load(Path(path), self.model, self.optimizer, self.scheduler)

    def restore_recorded(self, where: dict[str, str], data: bytes = b"") -> dict[str, Any]:
        """Load the checkpoint a record names: `{"dir": path}` of shards, or `{"object": name}` whose bytes are
        `data`; return its `extra`."""
        return self.restore_sharded(where["dir"]) if "dir" in where else self.restore(data)

    def wait(self) -> None:
        """Wait for this rank's sharded save in progress, if any (its failure is raised here)."""
        self.sharded.wait()

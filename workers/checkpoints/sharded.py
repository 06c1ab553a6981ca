"""Sharded checkpoints: every trainer rank writes its own shards of the model and the optimizer into one
directory, in the background, and any number of ranks reads them back, each the slice it holds.

The tensors go through `torch.distributed.checkpoint` (DCP) as safetensors files, one per rank
(`shard-0000<rank+1>-model-00001-of-00001.safetensors`), each with the offsets of its shards in its header:
a reader of another world size finds the pieces of its own slice there (DCP's resharding). Everything
else (the lr schedule, the optimizer's hyperparameters, the actor's `extra`) is one JSON file that rank 0
writes. Nothing is pickled, so reading a planted checkpoint cannot run code; DCP's own `.metadata` file (a
pickle) is neither written nor read.

`save` stages a copy of every tensor (the next step may change the weights in place), then writes in a
thread; the ranks meet over a gloo group of their own, so the writes never interleave with the training's
collectives. The returned future resolves once every rank's files are whole: only then may the caller
name the checkpoint anywhere.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from workers.errors import CheckpointRefused, CheckpointWriteFailed

STATE_FILE = "state.json"
"""The non-tensor part of a sharded checkpoint (rank 0 writes it)."""
MODEL, OPTIM = "model/", "optim/"
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer state keyed `state.<param fqn>.<name>` / `param_groups.<param fqn>.<name>`: the same keys on any
world size, so shards written by N ranks load on M."""


def tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this rank's tensors, sharded where FSDP2 shards them, keyed `model/<fqn>` and `optim/<flat key>`;
    the optimizer's plain values: lr, betas, ...). A fresh optimizer gets its state created (DCP's zero step)."""
    optim = get_optimizer_state_dict(model, optimizer, options=FLAT)
    tensors = {MODEL + k: v for k, v in get_model_state_dict(model).items()}
    tensors.update({OPTIM + k: v for k, v in optim.items() if isinstance(v, torch.Tensor)})
    plain = {k: v for k, v in optim.items() if not isinstance(v, torch.Tensor)}
    return tensors, plain


class ShardedCheckpoints:
    """One trainer rank's side of sharded checkpoints. Every rank makes the same calls in the same order
    (`workers.training.distributed` mirrors them), the first of which forms the ranks' gloo group."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world
        self._group: Any = None
        self._pending: Future[Any] | None = None

    def group(self) -> Any:
        if self._group is None and self.world > 1:
            self._group = dist.new_group(backend="gloo")  # a collective: every rank forms it at its first call
        return self._group

    def save(
        self,
        path: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        extra: dict[str, Any],
    ) -> Future[Any]:
        """Start writing this rank's shards to `path` (a directory, replaced); return when the tensors are staged.
        The future resolves once every rank has written."""
        self.wait()
        group = self.group()
        tensors, plain = tensor_state(model, optimizer)
        if self.rank == 0:  # before any rank writes: DCP plans over the group first, which waits for rank 0
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            state = {"optimizer": plain, "scheduler": scheduler.state_dict(), "extra": extra, "world": self.world}
            (path / STATE_FILE).write_text(json.dumps(state))
        writer = HuggingFaceStorageWriter(str(path), save_distributed=True)
        saving = dcp.async_save(tensors, storage_writer=writer, process_group=group, no_dist=self.world == 1)
        assert isinstance(saving, Future)  # the thread checkpointer, no stager given
        written: Future[None] = Future()

        def settle(done: Future[Any]) -> None:
            try:
                done.result()
            except CheckpointException as err:  # a BaseException: made an ordinary error with its ranks' reasons
                written.set_exception(CheckpointWriteFailed(f"checkpoint {path} not written: {_reasons(err)}"))
            except Exception as err:
                written.set_exception(err)
            else:
                written.set_result(None)

        saving.add_done_callback(settle)
        self._pending = written
        return written

    def wait(self) -> None:
        """Wait for this rank's save in progress, if any (its failure is raised here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict:
        """Load the checkpoint in `path`, each rank its own slice; return its `extra`."""
        self.wait()
        state = read_state(path)
        tensors, _ = tensor_state(model, optimizer)
        try:
            reader = HuggingFaceStorageReader(str(path))
            dcp.load(tensors, storage_reader=reader, process_group=self.group(), no_dist=self.world == 1)
        except CheckpointException as err:  # a shard missing, short or of another model
            raise CheckpointRefused(f"checkpoint {path} refused, not loaded: {_reasons(err)}") from None
        set_model_state_dict(model, {k[len(MODEL) :]: v for k, v in tensors.items() if k.startswith(MODEL)})
        optim = {**state["optimizer"], **{k[len(OPTIM) :]: v for k, v in tensors.items() if k.startswith(OPTIM)}}
        set_optimizer_state_dict(model, optimizer, optim, options=FLAT)
        scheduler.load_state_dict(state["scheduler"])
        return dict(state["extra"])


def read_state(path: Path) -> dict[str, Any]:
    """The JSON part of the checkpoint in `path`; CheckpointRefused when it is missing or not one."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointRefused(f"checkpoint {path} refused: {err}") from None
    if not isinstance(state, dict) or not {"optimizer", "scheduler", "extra"} <= state.keys():
        raise CheckpointRefused(f"checkpoint {path} refused: {STATE_FILE} is not a trainer checkpoint's")
    return state


def read_model(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole model of the checkpoint in `path`, in one process, shaped as `like` (a model's state dict,
    e.g. the base model's): for export. Tied weights absent from the checkpoint are left out."""
    read_state(path)
    reader = HuggingFaceStorageReader(str(path))
    stored = reader.read_metadata().state_dict_metadata
    out = {k: torch.empty_like(v) for k, v in like.items() if MODEL + k in stored}
    try:
        dcp.load({MODEL + k: v for k, v in out.items()}, storage_reader=reader, no_dist=True)
    except CheckpointException as err:
        raise CheckpointRefused(f"checkpoint {path} refused, not loaded: {_reasons(err)}") from None
    return out


def _reasons(err: CheckpointException) -> str:
    """Each failed rank's error, on one line."""
    return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(err.failures.items()))

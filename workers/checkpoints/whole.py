"""Whole checkpoints in and out: the model and optimizer gathered on rank 0 into tensors of their own (the next
step cannot change them), written as bytes, and read back without running code on any world size."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from workers.errors import CheckpointRefused

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Whole tensors on the CPU, on rank 0 (a collective under FSDP2)."""


def whole_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, extra: dict, base: str | None = None
) -> dict:
    """Model, optimizer, lr schedule and `extra` as they are now, in tensors of their own (a collective; rank 0
    gets the tensors), for `write_checkpoint`. With `base` (a LoRA trainer: the frozen base's digest) the model
    part is the trained parameters only, and the digest is kept beside them."""
    optim = get_optimizer_state_dict(model, optimizer, options=FULL)
    trained = {k for k, p in model.named_parameters() if p.requires_grad} if base is not None else None
    weights = get_model_state_dict(model, options=FULL)
    state = {
        "model": {k: v.detach().to("cpu", copy=True) for k, v in weights.items() if trained is None or k in trained},
        "optimizer": cloned(optim),
        "scheduler": copy.deepcopy(scheduler.state_dict()),
        "extra": copy.deepcopy(extra),
    }
    return state if base is None else {**state, "base": base}


def load_whole(
    data: bytes,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    world: int,
    base: str | None = None,
) -> dict:
    """Load checkpoint bytes (`write_checkpoint`'s) into every rank (ranks > 0 may pass b""); return its `extra`.
    With `base` (a LoRA trainer) the checkpoint must hold the trained parameters of that same base:
    CheckpointRefused when it names another base's digest or none."""
    empty: dict[str, Any] = {"model": {}, "optimizer": {}, "extra": {}}
    state = read_checkpoint(data) if data else empty
    if base is not None and data and state.get("base") != base:
        raise CheckpointRefused(
            f"checkpoint refused: it adapts base {str(state.get('base'))[:16]}..., "
            f"this trainer's base is {base[:16]}..."
        )
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=world > 1, strict=base is None)
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    schedule = [state.get("scheduler")]
    if world > 1:  # ranks > 0 read no checkpoint, but their optimizer shards need the same lr
        dist.broadcast_object_list(schedule, src=0)
    if schedule[0] is not None:
        scheduler.load_state_dict(schedule[0])
    return dict(state["extra"])


def write_checkpoint(state: dict[str, Any]) -> bytes:
    """`state` (tensors, containers and numbers only) as the bytes `read_checkpoint` reads."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def read_checkpoint(data: bytes) -> dict[str, Any]:
    """A checkpoint written by `TrainerCheckpoints.to_bytes`, read without running code: `torch.load` with
    `weights_only=True` accepts tensors, containers and numbers only. CheckpointRefused otherwise."""
    try:
        state = torch.load(io.BytesIO(data), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        raise CheckpointRefused(f"checkpoint refused, not loaded: {str(err).splitlines()[0]}") from None
    if not isinstance(state, dict) or not {"model", "optimizer", "extra"} <= state.keys():
        raise CheckpointRefused("checkpoint refused: not a trainer checkpoint (model, optimizer, extra)")
    return state


def cloned(value: Any) -> Any:
    """`value` with every tensor inside copied (containers rebuilt, other leaves kept)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: cloned(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(cloned(v) for v in value)
    return value

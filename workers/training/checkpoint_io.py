"""Checkpoint bytes in and out: read without running code, and snapshots that the next step cannot change."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from workers.errors import CheckpointRefused


def write_checkpoint(state: dict[str, Any]) -> bytes:
    """`state` (tensors, containers and numbers only) as the bytes `read_checkpoint` reads."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def read_checkpoint(data: bytes) -> dict[str, Any]:
    """A checkpoint written by `PolicyTrainer.checkpoint_bytes`, read without running code: `torch.load` with
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

"""Where the trainer runs and in what precision, and joining torchrun's process group.

    trainer.compute.device     auto -> cuda:<LOCAL_RANK> when CUDA is present, else cpu
    trainer.compute.precision  auto -> bf16 on CUDA, fp32 on CPU

bf16 keeps fp32 master weights and optimizer state: one process computes under `torch.autocast`,
FSDP2 casts the gathered parameters with a `MixedPrecisionPolicy` (bf16 compute, fp32 gradient
reduction). The process group is gloo for CPU tensors, plus nccl for CUDA tensors where CUDA exists,
so one group serves a CPU or a GPU trainer and the object broadcasts of `workers.training.distributed`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


def resolve_device(kind: str) -> torch.device:
    """The torch device for `trainer.compute.device`; ValueError when `cuda` is asked for on a machine without it."""
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            "trainer.compute.device is 'cuda' but torch sees no CUDA device (torch.cuda.is_available() is False)"
        )
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def reads_ahead(trainer: Any) -> bool:
    """Whether the actor decodes the next step's groups while a step trains (`trainer.compute.read_ahead`, a
    `TrainerConfig`): `auto` reads ahead unless the update computes on the CPU (a simulated step sleeps)."""
    if trainer.compute.read_ahead != "auto":
        return bool(trainer.compute.read_ahead == "on")
    return trainer.simulate is not None or resolve_device(trainer.compute.device).type != "cpu"


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype of matrix multiplies for `trainer.compute.precision` on `device`."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


@contextlib.contextmanager
def autocast(device: torch.device, dtype: torch.dtype, enabled: bool) -> Iterator[None]:
    """`torch.autocast` to `dtype` when enabled and not fp32; a no-op otherwise."""
    if not enabled or dtype == torch.float32:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def init_distributed() -> None:
    """Join the torchrun process group when launched by torchrun (gloo, and nccl for CUDA tensors)."""
    if "RANK" in os.environ and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("cpu:gloo,cuda:nccl")
        else:
            dist.init_process_group("gloo")

"""Weight transports: how the trainer's weights of version v reach the rollout and reference roles.

The default transport keeps one safetensors object per version in the run's `weights` object store
(read back with the bus's chunked reader), so nothing needs a shared filesystem. `filesystem` writes
the same files under a directory every worker mounts. An NCCL broadcast for GPU clusters plugs in
here the same way: one small class and one registry line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from relax_bus.bus import Bus
from relax_bus.errors import BlobNotFound
from relax_bus.log import get_logger
from relax_bus.outage import through_outage
from schemas import WeightsAnnouncement

log = get_logger(__name__)

StateDict = dict[str, torch.Tensor]


def to_bytes(state: StateDict) -> bytes:
    """Serialize a state dict as safetensors (tied tensors are written once each, as copies)."""
    return st_save({k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()})


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def from_buffer(buf: bytearray | memoryview) -> StateDict:
    """The tensors of a safetensors buffer as views into it, without copying (the buffer is theirs from now on).

    Layout: 8-byte little-endian header length n, a JSON header {name: {dtype, shape, data_offsets}},
    then the data. Falls back to a copying load for a dtype not listed or a misaligned tensor.
    """
    n = int.from_bytes(buf[:8], "little")
    header = json.loads(bytes(buf[8 : 8 + n]))
    header.pop("__metadata__", None)
    base = 8 + n
    state: StateDict = {}
    for name, spec in header.items():
        dtype = SAFETENSORS_DTYPES.get(spec["dtype"])
        start, end = spec["data_offsets"]
        if dtype is None or (base + start) % dtype.itemsize:
            return st_load(bytes(buf))
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=end - start, offset=base + start) if end > start else None
        tensor = raw.view(dtype) if raw is not None else torch.empty(0, dtype=dtype)
        state[name] = tensor.reshape(spec["shape"])
    return state


class WeightTransport(Protocol):
    """Moves full state dicts by policy version."""

    async def publish(self, version: int, state: StateDict, step: int) -> WeightsAnnouncement: ...

    async def fetch(self, version: int) -> StateDict: ...


class ObjectStoreTransport:
    """Weights as objects `v<version>` in the run's weights store; keeps v0 and the newest `keep`."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.keep = bus.config.bus.weights_keep

    async def publish(self, version: int, state: StateDict, step: int) -> WeightsAnnouncement:
        data = to_bytes(state)
        name = f"v{version}"
        info = await through_outage(lambda: self.bus.weights.put(name, data), f"put weights {name}")
        stale = version - self.keep
        if stale > 0:  # v0 stays: the reference role and restarts from scratch read it
            await through_outage(lambda: self.bus.weights.delete(f"v{stale}"), f"delete weights v{stale}")
        return WeightsAnnouncement(
            run=self.bus.run,
            version=version,
            location=info.name,
            size=len(data),
            step=step,
            digest=None,
        )

    async def fetch(self, version: int) -> StateDict:
        started = time.perf_counter()
        data = await self.bus.weights.get_buffer(f"v{version}")
        state = from_buffer(data)
        log.debug(
            "weights_fetched",
            version=version,
            mib=round(len(data) / 2**20, 2),
            seconds=round(time.perf_counter() - started, 3),
        )
        return state


class FilesystemTransport:
    """Weights as `<dir>/<run>/v<version>.safetensors` on a filesystem every worker mounts."""

    def __init__(self, bus: Bus, root: Path) -> None:
        self.bus = bus
        self.dir = root / bus.run
        self.dir.mkdir(parents=True, exist_ok=True)

    async def publish(self, version: int, state: StateDict, step: int) -> WeightsAnnouncement:
        path = self.dir / f"v{version}.safetensors"
        tmp = path.with_suffix(".tmp")
        data = to_bytes(state)
        tmp.write_bytes(data)
        tmp.replace(path)
        return WeightsAnnouncement(
            run=self.bus.run, version=version, transport="filesystem", location=str(path), size=len(data), step=step
        )

    async def fetch(self, version: int) -> StateDict:
        path = self.dir / f"v{version}.safetensors"
        if not path.exists():
            raise BlobNotFound(f"no weights file {path}")
        return st_load(path.read_bytes())


TRANSPORTS = {"object_store": ObjectStoreTransport}


def make_transport(bus: Bus, kind: str = "object_store") -> WeightTransport:
    """The weight transport named `kind`."""
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {kind!r} (known: {', '.join(sorted(TRANSPORTS))}, filesystem)")
    return TRANSPORTS[kind](bus)  # type: ignore[no-any-return]

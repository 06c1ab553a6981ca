"""Weight transports: how the trainer's weights of version v reach the rollout and reference roles.

The default transport keeps one safetensors object per version in the run's `weights` object store
(read back with the bus's chunked reader), so nothing needs a shared filesystem. `filesystem` writes
the same files under a directory every worker mounts. `shm` writes them into shared memory on one host,
laid out so that a fetch maps them and builds the tensors as views, without a copy. An NCCL broadcast
for GPU clusters plugs in here the same way: one small class and one registry line.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import re
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

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


SAFETENSORS_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


def from_buffer(buf: bytearray | memoryview | mmap.mmap) -> StateDict:
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
        data = await asyncio.to_thread(to_bytes, state)  # seconds for a real model: not on the event loop
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
    """Weights as `<root>/<run>/v<version>.safetensors` on a filesystem every worker mounts
    (`weights: {type: filesystem, root: DIR}`); keeps v0 and the newest `bus.weights_keep`."""

    def __init__(self, bus: Bus, root: Path) -> None:
        self.bus = bus
        self.keep = bus.config.bus.weights_keep
        self.dir = root / bus.run
        self.dir.mkdir(parents=True, exist_ok=True)

    async def publish(self, version: int, state: StateDict, step: int) -> WeightsAnnouncement:
        path = self.dir / f"v{version}.safetensors"
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        data = await asyncio.to_thread(to_bytes, state)  # seconds for a real model: not on the event loop
        await asyncio.to_thread(tmp.write_bytes, data)
        tmp.replace(path)  # readers see a whole file or none
        stale = version - self.keep
        if stale > 0:  # v0 stays, as in the object store
            (self.dir / f"v{stale}.safetensors").unlink(missing_ok=True)
        return WeightsAnnouncement(
            run=self.bus.run, version=version, transport="filesystem", location=str(path), size=len(data), step=step
        )

    async def fetch(self, version: int) -> StateDict:
        path = self.dir / f"v{version}.safetensors"
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise BlobNotFound(f"no weights file {path} (is {self.dir} shared by every process of the run?)") from None
        return st_load(data)


class SharedMemoryTransport:
    """Weights as `<root>/relax-<uid>/<run>/v<version>.safetensors` in shared memory (tmpfs) for a trainer
    and engines on one host (`weights: {type: shm}`); keeps v0 and the newest `keep`.

    Publish writes every tensor once, straight into a temp segment laid out as safetensors with
    each tensor aligned to its dtype (largest items first, data from a 64-byte boundary), then renames
    it into place: a reader sees a whole segment or none, and the announcement follows the rename.
    Fetch maps the segment copy-on-write and returns tensors that are views into it, so the engine's
    in-place load is the only copy; a write into a view stays private to that process, and a pruned
    segment stays readable by whoever still maps it (its memory is freed when the last view goes).

    Lifetime: only the publisher unlinks. Each publish prunes every version between v0 and the newest
    `keep` (leftovers of a publisher that died included, and temp segments of dead processes), so after
    a crash the segments stay until the next publish; `remove_run` deletes a finished run's folder.
    Safety: the folder is created 0700 and checked to be this uid's own, each segment is created 0600.
    """

    def __init__(self, run: str, keep: int, root: Path = Path("/dev/shm")) -> None:
        self.run = run
        self.keep = keep
        self.dir = root / f"relax-{os.getuid()}" / run

    async def publish(self, version: int, state: StateDict, step: int) -> WeightsAnnouncement:
        path = self.dir / f"v{version}.safetensors"
        size = await asyncio.to_thread(self._write, path, state)
        self._prune(version)
        return WeightsAnnouncement(
            run=self.run, version=version, transport="shm", location=str(path), size=size, step=step
        )

    async def fetch(self, version: int) -> StateDict:
        path = self.dir / f"v{version}.safetensors"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise BlobNotFound(self._missing(version)) from None
        try:
            for folder in (self.dir.parent, self.dir):
                check_private(folder)
            mapped = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)  # the mapping keeps the segment alive
        return from_buffer(mapped)

    def remove_run(self) -> None:
        """Delete every segment of the run (when it is over; a fetch afterwards raises BlobNotFound)."""
        shutil.rmtree(self.dir, ignore_errors=True)

    def _write(self, path: Path, state: StateDict) -> int:
        for folder in (self.dir.parent, self.dir):
            private_dir(folder)
        header, slots = shm_layout(state)
        size = len(header) + sum(t.numel() * t.element_size() for _, t in slots)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            write_at(fd, 0, memoryview(header))
            for offset, tensor in slots:
                write_at(fd, offset, tensor_bytes(tensor))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        tmp.rename(path)  # readers see a whole segment or none
        return size

    def _prune(self, newest: int) -> None:
        for entry in self.dir.iterdir():
            done = re.fullmatch(r"v(\d+)\.safetensors", entry.name)
            temp = re.fullmatch(r"\.v\d+\.safetensors\.tmp-(\d+)", entry.name)
            old = done is not None and 0 < int(done[1]) <= newest - self.keep  # v0 stays, as in the object store
            orphan = temp is not None and not pid_alive(int(temp[1]))
            if old or orphan:
                entry.unlink(missing_ok=True)

    def _missing(self, version: int) -> str:
        if not self.dir.is_dir():
            return (
                f"shm weights: no segments of run {self.run} in {self.dir} on this host (the shm transport "
                "needs the trainer and every engine on one host; use object_store or filesystem across hosts)"
            )
        kept = sorted(int(m[1]) for p in self.dir.iterdir() if (m := re.fullmatch(r"v(\d+)\.safetensors", p.name)))
        return f"shm weights v{version} of run {self.run} are gone from {self.dir} (kept: {kept})"


def shm_layout(state: StateDict) -> tuple[bytes, list[tuple[int, torch.Tensor]]]:
    """A safetensors header for `state` and each tensor's absolute offset after it, every tensor aligned
    to its item size: largest items first, header padded with spaces so the data starts at 64 bytes."""
    tensors = sorted(state.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets, at = [], 0
    for name, tensor in tensors:
        code = SAFETENSORS_CODES.get(tensor.dtype)
        if code is None:
            raise ValueError(f"shm weights: tensor {name} has dtype {tensor.dtype}, which safetensors cannot hold")
        end = at + tensor.numel() * tensor.element_size()
        header[name] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [at, end]}
        offsets.append(at)
        at = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 64)
    base = 8 + len(text)
    head = len(text).to_bytes(8, "little") + text
    return head, [(base + off, t.detach()) for off, (_, t) in zip(offsets, tensors, strict=True)]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of `tensor` in row-major order (copied first only if it is not a contiguous CPU tensor)."""
    flat = tensor.to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_at(fd: int, offset: int, data: memoryview) -> None:
    """Write all of `data` at `offset` (a plain write: on tmpfs about twice as fast as faulting in a mapping)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + (1 << 26)], offset + done)


def private_dir(path: Path) -> None:
    """Create `path` with mode 0700 if missing; refuse one that is not this uid's own or others may write."""
    path.mkdir(mode=0o700, exist_ok=True)
    check_private(path)


def check_private(path: Path) -> None:
    """Refuse a folder another uid owns or may write (it could plant or swap segments)."""
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise PermissionError(
            f"shm weights: {path} must be a directory owned by uid {os.getuid()} that only it can write"
        )


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (a temp segment of a dead one is garbage)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another uid
        return True
    return True


TRANSPORTS: dict[str, Callable[[Bus, Any], WeightTransport]] = {
    "object_store": lambda bus, cfg: ObjectStoreTransport(bus),
    "filesystem": lambda bus, cfg: FilesystemTransport(bus, Path(cfg.root)),
    "shm": lambda bus, cfg: SharedMemoryTransport(bus.run, bus.config.bus.weights_keep, Path(cfg.dir)),
}
"""Weight transports by `weights.type` (`workers.config.WeightsConfig`)."""


def make_transport(bus: Bus) -> WeightTransport:
    """The weight transport the run config names (`weights:`), behind the delta / bfloat16 wire when asked for."""
    cfg = bus.config.weights
    transport = TRANSPORTS[cfg.type](bus, cfg)
    if not cfg.delta and cfg.wire_dtype == "float32":
        return transport
    from workers.weights_wire import WireTransport  # imports this module: only when a run asks for it

    return WireTransport(transport, cfg.delta, cfg.wire_dtype)

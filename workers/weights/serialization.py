"""Weights as safetensors bytes: the format every transport moves.

A buffer is laid out by `layout`: every tensor aligned to its item size, so a reader builds the tensors as
views into the bytes it read or mapped (`from_buffer`), and the header's metadata names the SHA-256 of the
data section (`check_digest` refuses a buffer whose bytes differ from what was published: `BlobCorrupt`).
"""

from __future__ import annotations

import hashlib
import json
import mmap
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from relax_bus.errors import BlobCorrupt
from workers.weights.transport import StateDict

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


def to_bytes(state: StateDict) -> bytes:
    """Serialize a state dict as safetensors (tied tensors are written once each, as copies)."""
    return st_save({k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()})


def from_buffer(buf: bytearray | memoryview | mmap.mmap) -> StateDict:
    """The tensors of a safetensors buffer as views into it, without copying (the buffer is theirs from now on).

    Layout: 8-byte little-endian header length n, a JSON header {name: {dtype, shape, data_offsets}},
    then the data. Falls back to a copying load for a dtype not listed or a misaligned tensor.
    """
    header, base = read_header(buf)
    header.pop("__metadata__", None)
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


def read_header(buf: bytearray | memoryview | mmap.mmap) -> tuple[dict[str, Any], int]:
    """A safetensors buffer's JSON header and where its data starts."""
    n = int.from_bytes(buf[:8], "little")
    return json.loads(bytes(buf[8 : 8 + n])), 8 + n


def check_digest(buf: bytearray | memoryview | mmap.mmap, where: str) -> None:
    """Refuse a buffer whose data is not what its publisher hashed (a file without a digest is refused too)."""
    header, base = read_header(buf)
    want = header.get("__metadata__", {}).get("sha256")
    if want is None:
        raise BlobCorrupt(f"{where} carries no sha256 in its metadata: it was not written by a weight transport")
    got = hashlib.sha256(memoryview(buf)[base:]).hexdigest()
    if got != want:
        raise BlobCorrupt(f"{where}: data sha256 {got[:16]}... differs from the published {want[:16]}...")


def layout(state: StateDict) -> tuple[bytes, list[tuple[int, torch.Tensor]]]:
    """A safetensors header for `state` and each tensor's absolute offset after it, every tensor aligned to its
    item size (largest items first, header padded with spaces so the data starts at 64 bytes); the metadata
    names the SHA-256 of the data section (one pass over the tensors)."""
    tensors = sorted(state.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {}
    offsets, at = [], 0
    sha = hashlib.sha256()
    for name, tensor in tensors:
        code = SAFETENSORS_CODES.get(tensor.dtype)
        if code is None:
            raise ValueError(f"weights: tensor {name} has dtype {tensor.dtype}, which safetensors cannot hold")
        end = at + tensor.numel() * tensor.element_size()
        header[name] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [at, end]}
        offsets.append(at)
        sha.update(tensor_bytes(tensor))
        at = end
    header["__metadata__"] = {"format": "pt", "sha256": sha.hexdigest()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 64)
    base = 8 + len(text)
    head = len(text).to_bytes(8, "little") + text
    return head, [(base + off, t.detach()) for off, (_, t) in zip(offsets, tensors, strict=True)]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of `tensor` in row-major order (copied first only if it is not a contiguous CPU tensor)."""
    flat = tensor.to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")

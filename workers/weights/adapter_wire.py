"""Policy versions of a LoRA run (`trainer.lora`), over any transport: the base once, then adapters only.

`AdapterTransport` wraps the run's transport (`workers.weights.registry.make_transport`):

    v0        the frozen base (the model's own tensor names) and the adapter as warm-up left it
    v1, ...   the adapter's tensors only (`<path>.lora_A.weight`, `<path>.lora_B.weight`: MB, not GB)

Every version carries a record (a uint8 tensor `__relax_lora__` holding JSON): its kind (`base` or `adapter`), the
base's digest (sha256 over the base tensors' names, dtypes, shapes and bytes, taken once when v0 is published)
and the adapter's shape (rank, alpha, target modules). A reader remembers the digest of the base it read last.
An adapter version naming that digest comes back alone, to be applied on the base the engine already holds; one
naming another digest (a reader that has no base yet, or one from another run) makes the reader fetch v0 again
and return base and adapter together; if v0 names yet another digest, `WeightsBaseMismatch`. `weights.keep`
counts adapter versions, as it counts whole ones (v0 stays: it is the base).

`base_reads` and `adapter_reads` count what this reader fetched: a rollout worker started mid-run reads the base
once, then adapters only.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import torch

from relax_bus.log import get_logger
from schemas import WeightsAnnouncement
from workers.config.trainer_sections import LoraConfig
from workers.errors import WeightsBaseMismatch
from workers.weights.adapter import split
from workers.weights.serialization import tensor_bytes
from workers.weights.transport import StateDict, WeightTransport

log = get_logger(__name__)
RECORD = "__relax_lora__"


def base_digest(base: StateDict) -> str:
    """sha256 over the base's tensors in name order: name, dtype, shape, then the bytes (row-major)."""
    sha = hashlib.sha256()
    for name in sorted(base):
        tensor = base[name]
        sha.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        sha.update(tensor_bytes(tensor))
    return sha.hexdigest()


def encode_record(record: dict[str, Any]) -> torch.Tensor:
    """A record as the uint8 tensor that travels beside the weights."""
    return torch.frombuffer(bytearray(json.dumps(record, sort_keys=True).encode()), dtype=torch.uint8)


def take_record(state: StateDict, version: int) -> dict[str, Any]:
    """Pop and decode a version's record; WeightsBaseMismatch when it has none (not published by a LoRA run)."""
    tensor = state.pop(RECORD, None)
    if tensor is None:
        raise WeightsBaseMismatch(f"weights v{version} carry no LoRA record: not published by a trainer.lora run")
    record: dict[str, Any] = json.loads(bytes(tensor.numpy().tobytes()))
    return record


class AdapterTransport:
    """A weight transport that publishes the base at v0 and only the adapter after, fenced by the base's digest."""

    def __init__(self, inner: WeightTransport, lora: LoraConfig) -> None:
        self.inner = inner
        self.shape = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": sorted(lora.target_modules)}
        self.base: str | None = None
        """The digest of the base: the publisher's v0, or the one this reader read last (None: none yet)."""
        self.base_reads = 0
        """Versions this reader fetched with the base in them (v0, or a refetch after a digest mismatch)."""
        self.adapter_reads = 0
        """Adapter-only versions this reader fetched and returned alone."""

    async def publish(self, version: int, state: StateDict, step: int) -> WeightsAnnouncement:
        base, adapter = split(state)
        if not adapter:
            raise ValueError(f"weights v{version} of a trainer.lora run hold no adapter tensor")
        if version == 0:
            self.base = await asyncio.to_thread(base_digest, base)  # seconds for a real model: off the loop
            wire = {**state, RECORD: encode_record({"kind": "base", "base": self.base, **self.shape})}
        else:
            if base:
                raise ValueError(f"weights v{version}: only the adapter is published after v0, got {sorted(base)[:3]}")
            if self.base is None:  # a restarted trainer: the base's digest is in v0's record
                self.base = take_record(await self.inner.read(0), 0)["base"]
            wire = {**adapter, RECORD: encode_record({"kind": "adapter", "base": self.base, **self.shape})}
        return await self.inner.publish(version, wire, step)

    async def expect(self, version: int) -> None:
        await self.inner.expect(version)

    async def read(self, version: int) -> StateDict:
        got = await self.inner.read(version)
        record = take_record(got, version)
        if record["kind"] == "base":
            self.base, self.base_reads = record["base"], self.base_reads + 1
            self._log(version, "base")
            return got
        if record["base"] == self.base:
            self.adapter_reads += 1
            self._log(version, "adapter")
            return got
        # No base yet, or another one: the base this version was trained on is v0's, fetched once more.
        v0 = await self.inner.read(0)
        if take_record(v0, 0)["base"] != record["base"]:
            raise WeightsBaseMismatch(
                f"weights v{version} adapt base {record['base'][:16]}..., and this run's v0 is another base"
            )
        base, _ = split(v0)
        self.base, self.base_reads = record["base"], self.base_reads + 1
        self._log(version, "base+adapter")
        return {**base, **got}

    def _log(self, version: int, kind: str) -> None:
        log.info(
            "weights_adapter_read",
            version=version,
            kind=kind,
            base_reads=self.base_reads,
            adapter_reads=self.adapter_reads,
        )

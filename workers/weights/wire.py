"""Fewer bytes per weights version, over any transport: deltas against v0 and a bfloat16 wire (`weights.delta`,
`weights.wire_dtype`).

`WireTransport` wraps the run's transport (`workers.weights.registry.TRANSPORTS`). Version 0 always travels whole and
exact (the reference role and every reader's base). From v1 on:

    delta        only tensors whose bytes differ from v0's travel (frozen and never-updated ones stay behind);
                 the reader takes the others from its copy of v0
    bfloat16     float32 tensors that travel go as bfloat16 (half the bytes) and are widened back on fetch; the
                 engine then samples with weights rounded to bfloat16, which the trainer's off-policy
                 correction sees as rollout/trainer mismatch, as with any bfloat16 inference engine

Each version carries a manifest (a uint8 tensor `__relax_wire__` holding JSON): for every tensor of the state,
its dtype and the sha256 of the bytes the reader must end up with (v0's bytes for one left behind, the wire's
bytes for one that travelled). The reader checks every digest: a tensor taken from a v0 copy that is not the
run's v0 (a reader whose cache predates a restarted run, say) is caught, v0 fetched again once, and a mismatch
that remains raises `WeightsBaseMismatch`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import torch

from relax_bus.log import get_logger
from schemas import WeightsAnnouncement
from workers.errors import WeightsBaseMismatch
from workers.weights.transport import StateDict, WeightTransport

log = get_logger(__name__)
MANIFEST = "__relax_wire__"


def digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (row-major, as stored)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"").hexdigest()


class WireTransport:
    """A weight transport that publishes deltas against v0 and/or float32 as bfloat16 through another one."""

    def __init__(self, inner: WeightTransport, delta: bool, wire_dtype: str) -> None:
        self.inner = inner
        self.delta = delta
        self.narrow = wire_dtype == "bfloat16"
        self._base: StateDict | None = None
        """v0 as this process last fetched or published it."""
        self._base_digests: dict[str, str] | None = None

    async def publish(self, version: int, state: StateDict, step: int) -> WeightsAnnouncement:
        if version == 0:
            await asyncio.to_thread(self._remember_base, state, False)  # the publisher compares digests only
            return await self.inner.publish(0, state, step)
        if self.delta and self._base_digests is None:  # a restarted trainer: v0 is in the run, not in memory
            await asyncio.to_thread(self._remember_base, await self.inner.read(0), False)
        wire = await asyncio.to_thread(self._wire_form, state)  # hashing a real model takes seconds: off the loop
        announcement = await self.inner.publish(version, wire, step)
        log.debug("weights_wire", version=version, sent=len(wire) - 1, left_behind=len(state) - len(wire) + 1)
        return announcement

    def _wire_form(self, state: StateDict) -> StateDict:
        """The tensors that travel (narrowed where asked) plus the manifest."""
        wire, manifest = {}, {}
        for name, tensor in state.items():
            if self.delta and self._base_digests is not None and self._base_digests.get(name) == digest(tensor):
                manifest[name] = {"dtype": _dtype_name(tensor), "digest": self._base_digests[name], "from": "base"}
                continue
            sent = tensor.to(torch.bfloat16) if self.narrow and tensor.dtype == torch.float32 else tensor
            wire[name] = sent
            manifest[name] = {"dtype": _dtype_name(tensor), "digest": digest(sent), "from": "wire"}
        wire[MANIFEST] = torch.frombuffer(bytearray(json.dumps(manifest).encode()), dtype=torch.uint8)
        return wire

    async def expect(self, version: int) -> None:
        await self.inner.expect(version)

    async def read(self, version: int) -> StateDict:
        got = await self.inner.read(version)
        if version == 0 or MANIFEST not in got:
            if version == 0:
                await asyncio.to_thread(self._remember_base, got)
            return got
        manifest: dict[str, dict[str, Any]] = json.loads(bytes(got.pop(MANIFEST).numpy().tobytes()))
        try:
            return await asyncio.to_thread(self._rebuild, version, got, manifest)
        except WeightsBaseMismatch as err:  # no v0 yet, or one that is not the run's: fetch it once more
            log.info("weights_base_fetched", version=version, reason=str(err))
            await asyncio.to_thread(self._remember_base, await self.inner.read(0))
            return await asyncio.to_thread(self._rebuild, version, got, manifest)

    def _rebuild(self, version: int, got: StateDict, manifest: dict[str, dict[str, Any]]) -> StateDict:
        state: StateDict = {}
        for name, entry in manifest.items():
            if entry["from"] == "base":
                if self._base is None or name not in self._base:
                    raise WeightsBaseMismatch(f"v{version}: {name} is left to v0, which this reader does not hold")
                tensor = self._base[name]
            else:
                tensor = got[name]
            if digest(tensor) != entry["digest"]:
                raise WeightsBaseMismatch(f"v{version}: {name} does not match its digest ({entry['from']})")
            state[name] = tensor.to(getattr(torch, entry["dtype"]))
        return state

    def _remember_base(self, state: StateDict, keep: bool = True) -> None:
        """v0's digests, and (a reader, `keep`) its tensors."""
        if self.delta:
            self._base = {k: v.detach().clone() for k, v in state.items()} if keep else None
            self._base_digests = {k: digest(v) for k, v in state.items()}


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")

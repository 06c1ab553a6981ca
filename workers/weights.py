"""Weight transports: how the trainer's weights of version v reach the rollout and reference roles.

The default transport keeps one safetensors object per version in the run's `weights` object store
(read back with the bus's chunked reader), so nothing needs a shared filesystem. `filesystem` writes
the same files under a directory every worker mounts, `shm` into shared memory on one host, laid out so
that a fetch builds the tensors as views, without a copy (`workers.weights_files`). `broadcast` pushes each
version over a gloo group to the rollout engines that joined, beside the object store
(`workers.weights_broadcast`). Another transport plugs in the same way: one small class and one registry line.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from relax_bus.bus import Bus
from relax_bus.log import get_logger
from relax_bus.outage import through_outage
from schemas import WeightsAnnouncement
from workers.weights_broadcast import BroadcastTransport
from workers.weights_files import FilesystemTransport, SharedMemoryTransport, StateDict, from_buffer, to_bytes

__all__ = [
    "TRANSPORTS",
    "BroadcastTransport",
    "FilesystemTransport",
    "ObjectStoreTransport",
    "SharedMemoryTransport",
    "StateDict",
    "WeightTransport",
    "from_buffer",
    "make_transport",
    "to_bytes",
]

log = get_logger(__name__)


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


TRANSPORTS: dict[str, Callable[[Bus, Any], WeightTransport]] = {
    "object_store": lambda bus, cfg: ObjectStoreTransport(bus),
    "filesystem": lambda bus, cfg: FilesystemTransport(
        bus.run, bus.config.bus.weights_keep, Path(cfg.root), cfg.verify
    ),
    "shm": lambda bus, cfg: SharedMemoryTransport(bus.run, bus.config.bus.weights_keep, Path(cfg.dir), cfg.verify),
    "broadcast": lambda bus, cfg: BroadcastTransport(bus, cfg),
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

"""The weight transports by `weights.type`, and the one a run's config names."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_bus.bus import Bus
from workers.weights.adapter_wire import AdapterTransport
from workers.weights.broadcast import BroadcastTransport
from workers.weights.files import FilesystemTransport, SharedMemoryTransport
from workers.weights.object_store import ObjectStoreTransport
from workers.weights.transport import WeightTransport
from workers.weights.wire import WireTransport

TRANSPORTS: dict[str, Callable[[Bus, Any], WeightTransport]] = {
    "object_store": lambda bus, cfg: ObjectStoreTransport(bus, cfg.stream),
    "filesystem": lambda bus, cfg: FilesystemTransport(
        bus.run, bus.config.bus.weights_keep, Path(cfg.root), cfg.verify
    ),
    "shm": lambda bus, cfg: SharedMemoryTransport(bus.run, bus.config.bus.weights_keep, Path(cfg.dir), cfg.verify),
    "broadcast": lambda bus, cfg: BroadcastTransport(bus, cfg),
}
"""Weight transports by `weights.type` (`workers.config.WeightsConfig`)."""


def make_transport(bus: Bus) -> WeightTransport:
    """The weight transport the run config names (`weights:`), behind the delta / bfloat16 wire when asked for, and
    behind the adapter versions of a LoRA run (`trainer.lora`: the base once, then adapters only)."""
    cfg = bus.config.weights
    transport: WeightTransport = TRANSPORTS[cfg.type](bus, cfg)
    if cfg.delta or cfg.wire_dtype != "float32":
        transport = WireTransport(transport, cfg.delta, cfg.wire_dtype)
    lora = bus.config.trainer.lora
    return transport if lora is None else AdapterTransport(transport, lora)

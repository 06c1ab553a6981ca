"""Weight sync: publish and fetch-and-load of full state dicts through the object store, a file, memory.

    python benchmarks/weights_sync.py [--sizes 10,100,500] [--repeat 3] [--out FILE]

For each size (decimal MB of float32 tensors, shaped like a model: one embedding-sized tensor and
layers of a few large matrices) the transports move the same state dict, in one run:
- object store: `workers.weights.ObjectStoreTransport` on an embedded nats-server with file storage
  (the run's `weights` store, provisioned as `relax init` does). Publish = safetensors serialisation
  + pipelined chunk put + info record; fetch = chunked get + digest check + deserialisation.
- file: `workers.weights.FilesystemTransport` on the local disk (write + rename; read back while the
  file is still in the page cache, the best case of a shared filesystem), checking the sha256 of the data
  as the transport does by default; `file unverified` the same with `verify: false`.
- shm: `workers.weights.SharedMemoryTransport` in /dev/shm (publish = one copy of every tensor into a
  mapped segment + rename; fetch = map it, tensors as views: the load's copy is the only read);
  `shm verified` the same with `verify: true` (a sha256 pass over the segment on each fetch).
- memory: serialisation to bytes and deserialisation from them, nothing moved (the floor of any
  transport that uses safetensors).
- broadcast xN (`--receivers`, default 1,2,4): `workers.weights.broadcast.BroadcastTransport` with N readers
  that joined (threads of this process, gloo over the loopback; on 2 cores they share them). Publish = the
  round (every reader receives every bucket) and the object store's copy, side by side; `round` = the
  round alone; fetch = each reader's fetch (the version it received: no transfer left), the slowest counted.
Every fetch is followed by the same load: `copy_` of every tensor into preallocated parameters (what
`TorchEngine.load_state_dict` does). A plain `shutil.copyfile` of the safetensors file is timed too,
and a snapshot (`clone` of every tensor): what the trainer would wait for if a publish were streamed
off its critical path (snapshot, then serialise and store in the background), the floor of any publish.
With CUDA, a GPU trainer's snapshot is timed too: the state copied from the GPU into pinned host buffers.
Each case runs --repeat times alternating transports; the best is kept. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load

from relax_bus import log
from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.ops.server import EmbeddedServer
from relax_bus.provision import provision
from relax_bus.settings import ConnectionSettings
from workers.config import BroadcastWeights, PipelineConfig, parse_config
from workers.weights import (
    BroadcastTransport,
    FilesystemTransport,
    ObjectStoreTransport,
    SharedMemoryTransport,
    StateDict,
    to_bytes,
)

MB = 1_000_000


def make_state(size_mb: int) -> StateDict:
    """Float32 tensors totalling `size_mb` MB: an embedding (1/8) and square-ish layer matrices."""
    total = size_mb * MB // 4
    state: StateDict = {"model.embed_tokens.weight": torch.randn(total // 8)}
    left = total - total // 8
    per = 16 * MB // 4  # 16 MB matrices at most
    i = 0
    while left > 0:
        n = min(per, left)
        state[f"model.layers.{i // 4}.w{i % 4}"] = torch.randn(n)
        left -= n
        i += 1
    return state


def load_into(params: StateDict, state: StateDict) -> None:
    """Copy a fetched state dict into preallocated parameters (the engine's in-place load)."""
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


class MemoryTransport:
    """Serialise to bytes and back, moving nothing: the floor of a safetensors transport."""

    def __init__(self) -> None:
        self.blobs: dict[int, bytes] = {}

    async def publish(self, version: int, state: StateDict, step: int) -> None:
        self.blobs = {version: to_bytes(state)}

    async def read(self, version: int) -> StateDict:
        return st_load(self.blobs[version])


async def timed(transport: Any, version: int, state: StateDict, params: StateDict) -> dict[str, float]:
    started = time.perf_counter()
    await transport.publish(version, state, version)
    published = time.perf_counter()
    fetched_state = await transport.read(version)
    fetched = time.perf_counter()
    load_into(params, fetched_state)
    loaded = time.perf_counter()
    return {"publish_s": published - started, "fetch_s": fetched - published, "load_s": loaded - fetched}


class BroadcastCase:
    """A broadcast publisher and `n` readers that joined (each fetched a version after v0, then beat), in a run of
    their own (a run has one publisher: its rendezvous address is one KV key)."""

    def __init__(self, bus: Bus, n: int) -> None:
        cfg = BroadcastWeights(type="broadcast", timeout_s=60)
        self.publisher = BroadcastTransport(bus, cfg)
        self.readers = [BroadcastTransport(bus, cfg) for _ in range(n)]

    async def join(self, version: int) -> None:
        small = {"w": torch.zeros(4)}
        await self.publisher.publish(version, small, version)
        for reader in self.readers:
            await reader.read(version)  # from the store; starts the reader's receiver
        sender = self.publisher.sender
        assert sender is not None
        for _ in range(1200):  # a minute
            if len(sender.live_members()) == len(self.readers):
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{len(sender.live_members())} of {len(self.readers)} broadcast readers joined")

    async def publish(self, version: int, state: StateDict, step: int) -> None:
        await self.publisher.publish(version, state, step)

    async def read(self, version: int) -> StateDict:
        before = [r.received for r in self.readers]
        states = [await r.read(version) for r in self.readers]
        assert [r.received for r in self.readers] == [b + 1 for b in before], "a reader missed the broadcast"
        return states[-1]

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        self.publisher.close()


def file_copy_seconds(state: StateDict, work: Path) -> float:
    """Best of 3 `shutil.copyfile` of the state's safetensors file (page cache warm)."""
    src, dst = work / "copy-src.safetensors", work / "copy-dst.safetensors"
    src.write_bytes(to_bytes(state))
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        shutil.copyfile(src, dst)
        best = min(best, time.perf_counter() - started)
        dst.unlink()
    src.unlink()
    return best


def snapshot_seconds(state: StateDict) -> float:
    """Best of 3 clones of the state dict: the trainer's wait if publishing ran off its critical path."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        copy = {k: v.clone() for k, v in state.items()}
        best = min(best, time.perf_counter() - started)
        del copy
    return best


def gpu_snapshot_seconds(state: StateDict) -> float | None:
    """Best of 3 copies of the state from the GPU into pinned host buffers allocated once (a GPU trainer's
    snapshot before a publish off its critical path); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    on_gpu = {k: v.to("cuda") for k, v in state.items()}
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for k, v in on_gpu.items():
            pinned[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    del on_gpu, pinned
    torch.cuda.empty_cache()
    return best


async def bench(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    rows = []
    with EmbeddedServer(store_dir=work / "nats") as server:
        nc = await connect(ConnectionSettings(nats_url=[server.url]), name="weights-bench")
        transports: dict[str, Any] = {}
        try:
            config = parse_config({"run": f"w{uuid.uuid4().hex[:6]}", "bus": {"weights_keep": 1}})
            await provision(nc.jetstream(), config)
            bus = await Bus.attach(nc, config.run, PipelineConfig)
            shm = SharedMemoryTransport(f"bench-{config.run}", keep=1)
            shm_verify = SharedMemoryTransport(f"bench-{config.run}-verify", keep=1, verify=True)
            transports |= {
                "object store": ObjectStoreTransport(bus),
                "file": FilesystemTransport(config.run, 1, work / "fs"),
                "file unverified": FilesystemTransport(f"{config.run}-unverified", 1, work / "fs", verify=False),
                "shm": shm,
                "shm verified": shm_verify,
                "memory": MemoryTransport(),
            }
            version = 0
            for n in args.receivers:
                own = parse_config({"run": f"{config.run}-b{n}", "bus": {"weights_keep": 1}})
                await provision(nc.jetstream(), own)
                case = BroadcastCase(await Bus.attach(nc, own.run, PipelineConfig), n)
                version += 1
                await case.join(version)
                transports[f"broadcast x{n}"] = case
            for size in args.sizes:
                state = make_state(size)
                params = {k: torch.empty_like(v) for k, v in state.items()}
                nbytes = len(to_bytes(state))
                best: dict[str, dict[str, float]] = {}
                for _ in range(args.repeat):
                    for name, transport in transports.items():
                        version += 1
                        result = await timed(transport, version, state, params)
                        if isinstance(transport, BroadcastCase):
                            assert transport.publisher.sender is not None
                            result["round_s"] = transport.publisher.sender.round_s or float("nan")
                        if name.startswith("file"):  # keep the disk clean between rounds
                            for old in (work / "fs").glob("*/*.safetensors"):
                                if old.name != f"v{version}.safetensors":
                                    old.unlink()
                        total = result["fetch_s"] + result["load_s"]
                        if name not in best or total < best[name]["fetch_s"] + best[name]["load_s"]:
                            best[name] = result
                copy_s = file_copy_seconds(state, work)
                rows.append(row(size, nbytes, best, copy_s, snapshot_seconds(state)))
                if (gpu_s := gpu_snapshot_seconds(state)) is not None:
                    rows[-1]["gpu_snapshot_mb_per_s"] = nbytes / MB / gpu_s
                del state, params
            await bus.weights.delete(f"v{version}")
        finally:
            for case in transports.values():
                if isinstance(case, BroadcastCase):
                    case.close()
                elif isinstance(case, SharedMemoryTransport):
                    case.remove_run()
            await nc.close()
    return rows


def row(size: int, nbytes: int, best: dict[str, dict[str, float]], copy_s: float, snap_s: float) -> dict[str, Any]:
    mb = nbytes / MB
    out: dict[str, Any] = {
        "size_mb": size,
        "bytes": nbytes,
        "file_copy_mb_per_s": mb / copy_s,
        "snapshot_mb_per_s": mb / snap_s,
        "transports": {},
    }
    for name, r in best.items():
        out["transports"][name] = {
            **r,
            "publish_mb_per_s": mb / r["publish_s"],
            "fetch_mb_per_s": mb / r["fetch_s"],
            "fetch_load_mb_per_s": mb / (r["fetch_s"] + r["load_s"]),
            **({"round_mb_per_s": mb / r["round_s"]} if "round_s" in r else {}),
        }
    memory = out["transports"]["memory"]
    for t in out["transports"].values():
        t["fetch_load_vs_memory"] = t["fetch_load_mb_per_s"] / memory["fetch_load_mb_per_s"]
        t["publish_vs_snapshot"] = t["publish_mb_per_s"] / out["snapshot_mb_per_s"]
    store, file = out["transports"]["object store"], out["transports"]["file"]
    out["fetch_load_vs_file"] = store["fetch_load_mb_per_s"] / file["fetch_load_mb_per_s"]
    out["publish_vs_file"] = store["publish_mb_per_s"] / file["publish_mb_per_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="10,100,500", help="state dict sizes in MB (default 10,100,500)")
    p.add_argument("--receivers", default="1,2,4", help="readers of each broadcast case (default 1,2,4)")
    p.add_argument("--repeat", type=int, default=3, help="rounds per size; the best is kept (default 3)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "weights_sync.json"))
    args = p.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.receivers = [int(n) for n in args.receivers.split(",") if n]
    log.configure("warning")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="weights-bench-") as work:
        rows = asyncio.run(bench(args, Path(work)))

    header = (
        f"{'size':>6} {'transport':12} {'publish MB/s':>12} {'fetch MB/s':>10} {'fetch+load MB/s':>15} "
        f"{'fetch+load s':>12} {'vs file':>8} {'vs memory':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        file_rate = r["transports"]["file"]["fetch_load_mb_per_s"]
        for name, t in r["transports"].items():
            print(
                f"{r['size_mb']:>4}MB {name:12} {t['publish_mb_per_s']:12.0f} {t['fetch_mb_per_s']:10.0f} "
                f"{t['fetch_load_mb_per_s']:15.0f} {t['fetch_s'] + t['load_s']:12.3f} "
                f"{t['fetch_load_mb_per_s'] / file_rate:7.2f}x {t['fetch_load_vs_memory']:8.2f}x"
            )
            if "round_mb_per_s" in t:
                print(f"{'':6} {'  its round':12} {t['round_mb_per_s']:12.0f}")
        print(f"{'':6} {'cp (file)':12} {r['file_copy_mb_per_s']:12.0f}")
        print(f"{'':6} {'snapshot':12} {r['snapshot_mb_per_s']:12.0f}")
        if "gpu_snapshot_mb_per_s" in r:
            print(f"{'':6} {'GPU->pinned':12} {r['gpu_snapshot_mb_per_s']:12.0f}")
    print(
        f"MB = 10^6 bytes; best of {args.repeat}; publish = serialise + store; fetch = read back + deserialise; "
        "load = copy into preallocated parameters; vs file / vs memory = fetch+load rate / the file / memory "
        "transport's; snapshot = clone of the state dict (a publish streamed off the trainer's critical path); "
        "broadcast: publish = its round and the object store's copy side by side, its round = the round alone"
    )
    write_json(Path(args.out), rows)


def write_json(out: Path, rows: list[dict[str, Any]]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "weights_sync",
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                    "load_average_1_5_15m": os.getloadavg(),
                    "torch": torch.__version__,
                },
                "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

"""What reading an object by direct get costs against the ordered consumer it replaced: fetch MB/s of one object
through each read path, side by side in one run.

    python benchmarks/direct_get_reads.py [--mb 200] [--rounds 5] [--batches 4,16,64] [--out FILE]

One embedded nats-server (file storage) holds one object of `--mb` random bytes, stored with
`relax_bus.blobs.BlobStore.put`. Each round fetches it once per path, in turn, each time on a fresh connection:

- `ordered consumer`, the reference: the read path before roles lost the right to create consumers, kept here as
  a function (an ordered push consumer on the object's chunk subject, chunks copied into one buffer as they
  arrive, sha256 computed in the hashing thread and checked against the info record);
- `direct get xK`: `BlobStore.get_buffer` as it is now (batched direct get, `relax_bus.direct_get.read_all`),
  with K chunks asked for per request. The benchmark sets the module constant `relax_bus.blobs.CHUNKS_PER_READ`
  to K before each such fetch and restores it afterwards (there is no option for it).

Reported: the best and the median of the rounds per path, and each one's median as a ratio to the ordered
consumer's. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import mmap
import os
import platform
import statistics
import time
from pathlib import Path

import nats
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE

import relax_bus.blobs
from relax_bus.blobs import HASHER, BlobStore, matches_record
from relax_bus.ops.server import EmbeddedServer

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "reads"
REFERENCE = "ordered consumer"
TIMEOUT_S = 30.0


async def ordered_consumer_buffer(store: BlobStore, name: str) -> memoryview:
    """The object read the way `BlobStore.get_buffer` read it before direct get: one ordered push consumer on the
    chunk subject, each chunk copied into one anonymous buffer and hashed in order in `HASHER`, the digest checked
    after the last chunk."""
    info = await store.info_or_missing(name)
    size, chunks = info.size or 0, info.chunks or 0
    buf = memoryview(mmap.mmap(-1, size) if size else bytearray())
    sha = hashlib.sha256()
    hashed: list[asyncio.Future[None]] = []
    loop = asyncio.get_running_loop()
    offset = 0
    sub = await store.js.subscribe(
        OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=store.bucket, obj=info.nuid),
        stream=store.stream,
        ordered_consumer=True,
        pending_bytes_limit=512 << 20,
        pending_msgs_limit=1 << 20,
    )
    try:
        for _ in range(chunks):
            msg = await sub.next_msg(timeout=TIMEOUT_S)
            buf[offset : offset + len(msg.data)] = msg.data
            offset += len(msg.data)
            hashed.append(loop.run_in_executor(HASHER, sha.update, msg.data))
    finally:
        await sub.unsubscribe()
        await asyncio.gather(*hashed, return_exceptions=True)
    assert offset == size and matches_record(info, sha), "ordered consumer read the object wrong"
    return buf


async def direct_get_buffer(store: BlobStore, name: str, batch: int) -> memoryview:
    """The object read by `BlobStore.get_buffer` with `batch` chunks per direct-get request."""
    default = relax_bus.blobs.CHUNKS_PER_READ
    relax_bus.blobs.CHUNKS_PER_READ = batch  # read by BlobStore._chunks at each fetch
    try:
        return await store.get_buffer(name, timeout_s=TIMEOUT_S)
    finally:
        relax_bus.blobs.CHUNKS_PER_READ = default


async def fetch_mb_s(url: str, path: str, mb: int) -> float:
    nc = await nats.connect(url)
    try:
        store = BlobStore(nc.jetstream(), BUCKET, nc.max_payload)
        started = time.perf_counter()
        if path == REFERENCE:
            data = await ordered_consumer_buffer(store, "blob")
        else:
            data = await direct_get_buffer(store, "blob", int(path.removeprefix("direct get x")))
        seconds = time.perf_counter() - started
        assert len(data) == mb << 20
        return mb / seconds
    finally:
        await nc.close()


async def measure(mb: int, rounds: int, paths: list[str]) -> dict[str, list[float]]:
    with EmbeddedServer() as server:
        nc = await nats.connect(server.url)
        await nc.jetstream().create_object_store(BUCKET)  # allows direct get, as the run's stores do
        await BlobStore(nc.jetstream(), BUCKET, nc.max_payload).put("blob", os.urandom(mb << 20))
        await nc.close()
        rates: dict[str, list[float]] = {p: [] for p in paths}
        for r in range(rounds):
            for path in paths if r % 2 == 0 else reversed(paths):  # alternate the order: no path always first
                rates[path].append(await fetch_mb_s(server.url, path, mb))
            print(f"round {r + 1}: " + ", ".join(f"{p} {rates[p][-1]:.0f} MB/s" for p in paths), flush=True)
        return rates


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", default="4,16,64", help="chunks per direct-get request")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "direct_get_reads.json"))
    args = parser.parse_args()
    paths = [REFERENCE] + [f"direct get x{int(k)}" for k in args.batches.split(",")]
    load_before = os.getloadavg()
    rates = asyncio.run(measure(args.mb, args.rounds, paths))
    base = statistics.median(rates[REFERENCE])
    rows = []
    print(f"{'path':>18} {'best MB/s':>10} {'median MB/s':>12} {'median / ordered':>17}")
    for path in paths:
        best, median = max(rates[path]), statistics.median(rates[path])
        rows.append(
            {
                "path": path,
                "chunks_per_read": None if path == REFERENCE else int(path.removeprefix("direct get x")),
                "best_mb_s": best,
                "median_mb_s": median,
                "ratio_to_ordered_consumer": median / base,
                "all": rates[path],
            }
        )
        print(f"{path:>18} {best:>10.0f} {median:>12.0f} {median / base:>17.2f}")
    load_after = os.getloadavg()
    before, after = (", ".join(f"{x:.2f}" for x in load) for load in (load_before, load_after))
    print(f"load average (1, 5, 15 min): before {before}; after {after}")
    result = {
        "benchmark": "direct_get_reads",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python benchmarks/direct_get_reads.py "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "out"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "object_mb": args.mb,
        "default_chunks_per_read": relax_bus.blobs.CHUNKS_PER_READ,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

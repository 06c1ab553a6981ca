"""What larger socket reads give the object store's receive path: fetch MB/s of one object at several nats-py
read sizes, side by side in one run.

    python benchmarks/object_store_reads.py [--mb 200] [--rounds 5] [--reads 32,256,1024,4096] [--out FILE]

One embedded nats-server (file storage) holds one object of `--mb` random bytes in an object store; each round
fetches it once per read size, in turn, with a fresh connection (`relax_bus.blobs.BlobStore.get_buffer`, what
the object-store weight transport's readers do: chunks into one buffer, sha256 checked). nats-py reads its
socket `nats.aio.client.DEFAULT_BUFFER_SIZE` bytes at a time (32 KiB); the benchmark sets that module constant
before each connection, which is how the size would be changed (nats-py has no option for it). Reported: the
best and the median of the rounds per size, and each one's ratio to 32 KiB. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

import nats
import nats.aio.client

from relax_bus.blobs import BlobStore
from relax_bus.ops.server import EmbeddedServer

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "reads"


async def fetch_mb_s(url: str, read_bytes: int, mb: int) -> float:
    nats.aio.client.DEFAULT_BUFFER_SIZE = read_bytes  # read by the client's reading loop at every read
    nc = await nats.connect(url)
    try:
        store = BlobStore(nc.jetstream(), BUCKET, nc.max_payload)
        started = time.perf_counter()
        data = await store.get_buffer("blob")
        seconds = time.perf_counter() - started
        assert len(data) == mb << 20
        return mb / seconds
    finally:
        await nc.close()


async def measure(mb: int, rounds: int, reads_kib: list[int]) -> dict[int, list[float]]:
    with EmbeddedServer() as server:
        nc = await nats.connect(server.url)
        await nc.jetstream().create_object_store(BUCKET)
        await BlobStore(nc.jetstream(), BUCKET, nc.max_payload).put("blob", os.urandom(mb << 20))
        await nc.close()
        rates: dict[int, list[float]] = {k: [] for k in reads_kib}
        for r in range(rounds):
            for kib in reads_kib if r % 2 == 0 else reversed(reads_kib):  # alternate the order: no size always first
                rates[kib].append(await fetch_mb_s(server.url, kib << 10, mb))
            print(f"round {r + 1}: " + ", ".join(f"{k} KiB {rates[k][-1]:.0f} MB/s" for k in reads_kib), flush=True)
        return rates


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reads", default="32,256,1024,4096", help="read sizes in KiB")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "object_store_reads.json"))
    args = parser.parse_args()
    reads = [int(k) for k in args.reads.split(",")]
    default = nats.aio.client.DEFAULT_BUFFER_SIZE
    rates = asyncio.run(measure(args.mb, args.rounds, reads))
    base = statistics.median(rates[32]) if 32 in rates else None
    rows = []
    print(f"{'read KiB':>9} {'best MB/s':>10} {'median MB/s':>12} {'median / 32 KiB':>16}")
    for kib in reads:
        best, median = max(rates[kib]), statistics.median(rates[kib])
        ratio = median / base if base else None
        rows.append(
            {"read_kib": kib, "best_mb_s": best, "median_mb_s": median, "ratio_to_32k": ratio, "all": rates[kib]}
        )
        print(f"{kib:>9} {best:>10.0f} {median:>12.0f} {ratio if ratio is not None else float('nan'):>16.2f}")
    result = {
        "benchmark": "object_store_reads",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python benchmarks/object_store_reads.py "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "out"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_average": os.getloadavg()},
        "nats_py_default_read_bytes": default,
        "object_mb": args.mb,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Streamed object-store weights: how long from the start of a publish until a reader holds the version.

    python benchmarks/weights_stream.py [--sizes 100,500] [--repeat 3] [--out FILE]

One embedded nats-server (file storage), one run's `weights` store; the trainer's side in this process, a
rollout worker's side in a child process (its own event loop and connection, as in a run). For each size
(decimal MB of float32 tensors, `benchmarks/weights_sync.make_state`), alternating, --repeat times:
- after: the reader fetches once the publish has returned (what the version's announcement triggers when
  the reader was told nothing ahead): latency = publish + fetch.
- streamed: the reader was told the version comes next (`ObjectStoreTransport.expect`, what a rollout
  worker does after each load) and follows the upload's chunks while they are stored; it fetches once the
  publish has returned, which then only waits for the last chunks and the digest. Latency = from the start
  of the publish to the end of that fetch.
Publish = safetensors serialisation + chunk put + record; fetch = bytes + digest check + deserialisation
(tensors as views; the engine's load is the same in both cases and left out). The child reports its own
fetch time; the latency is measured here and includes one round trip of a pipe line per fetch.
Medians are kept. On a 2-core machine the child, the server and this process share the cores: a streamed
reader's receiving competes with the trainer's upload. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.weights_sync import MB, make_state  # noqa: E402
from relax_bus import log  # noqa: E402
from relax_bus.bus import Bus  # noqa: E402
from relax_bus.connection import connect  # noqa: E402
from relax_bus.ops.server import EmbeddedServer  # noqa: E402
from relax_bus.provision import provision  # noqa: E402
from relax_bus.settings import ConnectionSettings  # noqa: E402
from workers.config import PipelineConfig, parse_config  # noqa: E402
from workers.weights import ObjectStoreTransport, to_bytes  # noqa: E402

READER = """
import asyncio, sys, time
sys.path.insert(0, {root!r})
from relax_bus import log
from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.settings import ConnectionSettings
from workers.config import PipelineConfig
from workers.weights import ObjectStoreTransport

async def main():
    log.configure("warning")
    nc = await connect(ConnectionSettings(nats_url=[{url!r}]), name="stream-reader")
    transport = ObjectStoreTransport(await Bus.attach(nc, {run!r}, PipelineConfig))
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        verb, version = line.split()
        started = time.perf_counter()
        if verb == "prefetch":
            await transport.expect(int(version))
        else:
            await transport.read(int(version))
        print(f"{{time.perf_counter() - started}} {{transport.streamed}}", flush=True)

asyncio.run(main())
"""


class Reader:
    """The child process: one line in (`prefetch V` / `fetch V`), one line out (its seconds, versions streamed)."""

    def __init__(self, url: str, run: str) -> None:
        self.url, self.run = url, run
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        code = READER.format(root=str(ROOT), url=self.url, run=self.run)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        assert self.proc.stdout is not None
        if (await self.proc.stdout.readline()).strip() != b"ready":
            raise SystemExit("the reader process did not start")

    async def ask(self, verb: str, version: int) -> tuple[float, int]:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{verb} {version}\n".encode())
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the reader process died during {verb} {version}")
        seconds, streamed = line.split()
        return float(seconds), int(streamed)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()
            await self.proc.wait()


async def one(writer: ObjectStoreTransport, reader: Reader, version: int, state: Any, streamed: bool) -> dict:
    if streamed:
        await reader.ask("prefetch", version)
    started = time.perf_counter()
    await writer.publish(version, state, version)
    published = time.perf_counter()
    fetch_s, streamed_count = await reader.ask("fetch", version)
    done = time.perf_counter()
    return {
        "publish_s": published - started,
        "fetch_s": fetch_s,
        "latency_s": done - started,
        "streamed_total": streamed_count,
    }


async def bench(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    rows = []
    with EmbeddedServer(store_dir=work / "nats") as server:
        nc = await connect(ConnectionSettings(nats_url=[server.url]), name="stream-bench")
        config = parse_config({"run": f"ws{uuid.uuid4().hex[:6]}", "bus": {"weights_keep": 1}})
        await provision(nc.jetstream(), config)
        writer = ObjectStoreTransport(await Bus.attach(nc, config.run, PipelineConfig))
        reader = Reader(server.url, config.run)
        await reader.start()
        try:
            version = 0
            for size in args.sizes:
                state = make_state(size)
                nbytes = len(to_bytes(state))
                runs: dict[str, list[dict]] = {"after": [], "streamed": []}
                for _ in range(args.repeat):
                    for case in ("after", "streamed"):
                        version += 1
                        result = await one(writer, reader, version, state, case == "streamed")
                        runs[case].append(result)
                        print(f"{size} MB {case}: {result['latency_s']:.2f} s", flush=True)
                streamed_total = runs["streamed"][-1]["streamed_total"]
                med = {
                    case: {k: statistics.median(r[k] for r in rs) for k in ("publish_s", "fetch_s", "latency_s")}
                    for case, rs in runs.items()
                }
                rows.append(
                    {
                        "size_mb": size,
                        "bytes": nbytes,
                        "cases": med,
                        "runs": runs,
                        "streamed_fetches": streamed_total,
                        "latency_ratio_after_over_streamed": med["after"]["latency_s"] / med["streamed"]["latency_s"],
                    }
                )
                del state
        finally:
            await reader.stop()
            await nc.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="100,500", help="state dict sizes in MB (default 100,500)")
    p.add_argument("--repeat", type=int, default=3, help="rounds per size; medians are kept (default 3)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "weights_stream.json"))
    args = p.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    log.configure("warning")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="weights-stream-") as work:
        rows = asyncio.run(bench(args, Path(work)))
    head = f"{'size':>6} {'case':9} {'publish s':>9} {'fetch s':>8} {'latency s':>9} {'latency MB/s':>12}"
    print(head)
    print("-" * len(head))
    for r in rows:
        for case, c in r["cases"].items():
            print(
                f"{r['size_mb']:>4}MB {case:9} {c['publish_s']:9.2f} {c['fetch_s']:8.2f} {c['latency_s']:9.2f} "
                f"{r['bytes'] / MB / c['latency_s']:12.0f}"
            )
        print(f"{'':6} after / streamed latency: {r['latency_ratio_after_over_streamed']:.2f}x")
    print(
        f"median of {args.repeat}; latency = from the start of the publish until the reader holds the version; "
        "fetch = the reader's own time from the announcement (a streamed reader has most chunks by then)"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "load_average": os.getloadavg()}
    out.write_text(
        json.dumps(
            {
                "benchmark": "weights_stream",
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": machine,
                "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

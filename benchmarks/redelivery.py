"""Time to redelivery after a SIGKILL: how long a dead worker's in-flight messages stay out of reach.

For each `bus.ack_wait_s` asked for, on an embedded nats-server: a fresh run with `--messages` prompt groups; a worker
process of the rollout role takes them all and holds them (its handler never returns; the bus's keep-alive tells the
server every ack_wait/4 that they are in progress); after `--hold` x ack_wait the benchmark checks that nothing was
redelivered while the worker lived, SIGKILLs it, and pulls from the same durable until every message is back. The
seconds from the kill to the first and to the last redelivery are the dead worker's cost. The default hold (1.5 x
ack_wait, six keep-alive periods) kills the worker just after a keep-alive: the worst case, ack_wait itself (a kill
at a random time costs between 3/4 of ack_wait and ack_wait).

    python -m benchmarks.redelivery                       # ack_wait 60, 15, 10 and 5 s
    python -m benchmarks.redelivery --ack-wait 10 --hold 2

Prints a table and writes JSON to benchmarks/results/redelivery.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import nats

from relax_bus import log
from relax_bus.bus import Bus
from relax_bus.fetch import fetch_at_most
from relax_bus.ops.server import EmbeddedServer
from relax_bus.provision import provision
from relax_bus.settings import ConnectionSettings
from relax_bus.worker import Delivery, Worker, WorkerOptions
from schemas import PromptGroup, RolloutGroup, TextPart
from workers.config import PipelineConfig, parse_config

POLL_S = 0.05


def prompt(run: str, i: int) -> PromptGroup:
    return PromptGroup(
        run=run,
        group_id=f"g{i}",
        parts=(TextPart(text=f"{i}+1="),),
        answer=str(i + 1),
        n_samples=2,
        release_index=i,
        released_at_version=0,
        index=i,
    )


async def hold(url: str, run: str, concurrency: int) -> None:
    """The worker process: take messages and never finish them (kept alive by the bus until it is killed)."""
    bus = await Bus.connect(ConnectionSettings(nats_url=[url]), run, config_model=PipelineConfig)

    async def forever(group: PromptGroup, delivery: Delivery) -> RolloutGroup:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    await Worker(bus, "rollout", forever, PromptGroup, WorkerOptions(concurrency=concurrency)).run()


async def pending(js: Any, stream: str, durable: str) -> tuple[int, int]:
    info = await js.consumer_info(stream, durable)
    return info.num_ack_pending, info.num_redelivered


async def measure(url: str, ack_wait: float, messages: int, hold_for: float) -> dict[str, float]:
    """One run at `ack_wait`: the seconds from the SIGKILL to the first and the last redelivery."""
    config = parse_config(
        {
            "run": f"redeliv{uuid.uuid4().hex[:8]}",
            "bus": {"ack_wait_s": ack_wait, "duplicate_window_s": max(120.0, ack_wait), "max_deliver": 5},
        }
    )
    nc = await nats.connect(url, max_reconnect_attempts=1)
    js = nc.jetstream(timeout=10.0)
    await provision(js, config)
    bus = await Bus.attach(nc, config.run, PipelineConfig)
    for i in range(messages):
        await bus.publish("prompts", prompt(config.run, i))
    stream, durable = bus.topology.stream("prompts").name, bus.topology.consumer("prompts").durable
    child = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "benchmarks.redelivery", "--hold-as-worker", url, config.run, str(messages)),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        while (await pending(js, stream, durable))[0] < messages:
            if child.returncode is not None:
                raise RuntimeError(f"the worker process exited with {child.returncode}")
            await asyncio.sleep(POLL_S)
        await asyncio.sleep(hold_for * ack_wait)  # past ack_wait: only the keep-alive holds them now
        redelivered_alive = (await pending(js, stream, durable))[1]
        os.kill(child.pid, signal.SIGKILL)
        killed = time.monotonic()
        await child.wait()
        sub = await js.pull_subscribe_bind(durable, stream)
        back: list[float] = []
        while len(back) < messages:
            msgs = await fetch_at_most(sub, messages - len(back), 1.0)
            now = time.monotonic() - killed
            for m in msgs:
                back.append(now)
                await m.ack()
        await sub.unsubscribe()
    finally:
        if child.returncode is None:
            os.kill(child.pid, signal.SIGKILL)
            await child.wait()
        await nc.close()
    return {
        "ack_wait_s": ack_wait,
        "messages": messages,
        "held_s": hold_for * ack_wait,
        "redelivered_while_alive": redelivered_alive,
        "first_s": min(back),
        "last_s": max(back),
    }


async def compare(url: str, ack_waits: list[float], messages: int, hold_for: float) -> list[dict[str, float]]:
    rows = []
    for ack_wait in ack_waits:
        r = await measure(url, ack_wait, messages, hold_for)
        rows.append(r)
        print(
            f"ack_wait {r['ack_wait_s']:>5g} s  held {r['held_s']:>5.1f} s, redelivered meanwhile "
            f"{r['redelivered_while_alive']:g}  SIGKILL -> first back {r['first_s']:5.1f} s, last {r['last_s']:5.1f} s",
            flush=True,
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ack-wait", type=float, nargs="+", default=[60.0, 15.0, 10.0, 5.0], help="seconds to compare")
    p.add_argument("--messages", type=int, default=4, help="messages the killed worker holds (default 4)")
    p.add_argument("--hold", type=float, default=1.5, help="how long the worker holds them, x ack_wait (default 1.5)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "redelivery.json"))
    p.add_argument("--hold-as-worker", nargs=3, metavar=("URL", "RUN", "CONCURRENCY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    log.configure("warning")
    if args.hold_as_worker:
        url, run, concurrency = args.hold_as_worker
        asyncio.run(hold(url, run, int(concurrency)))
        return
    with EmbeddedServer() as server:
        rows = asyncio.run(compare(server.url, args.ack_wait, args.messages, args.hold))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "argv": sys.argv[1:]}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

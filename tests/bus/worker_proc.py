"""A rollout-shaped worker process for crash and shutdown tests.

Consumes prompt groups, logs `start <group_id>` and `done <group_id>` lines to --log, sleeps
--sleep seconds (the "generation"), and emits a rollout group. Run as `python -m tests.bus.worker_proc`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from relax_bus import log
from relax_bus.bus import Bus
from relax_bus.settings import ConnectionSettings
from relax_bus.worker import Delivery, Worker, WorkerOptions
from schemas import PromptGroup, RolloutGroup
from tests import factories as f
from workers.config import PipelineConfig


async def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--nats-url", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--grace", type=float, default=30.0)
    args = p.parse_args()
    log.configure("info", json=True)
    bus = await Bus.connect(ConnectionSettings(nats_url=[args.nats_url]), args.run, config_model=PipelineConfig)

    def note(line: str) -> None:
        with open(args.log, "a") as out:
            out.write(line + "\n")

    async def handler(prompt: PromptGroup, delivery: Delivery) -> RolloutGroup:
        note(f"start {prompt.group_id} {delivery.deliveries}")
        await asyncio.sleep(args.sleep)
        note(f"done {prompt.group_id}")
        return f.rollout(prompt)

    worker = Worker(
        bus, "rollout", handler, PromptGroup, WorkerOptions(concurrency=args.concurrency, grace_s=args.grace)
    )
    await worker.run(handle_signals=True)
    await bus.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

"""The reference role: log-probs of every sampled response under the initial policy (version 0).

In the chain only when `trainer.kl_coef > 0`: scored -> reference -> train.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from relax_bus.bus import Bus
from relax_bus.log import get_logger
from relax_bus.version import VersionTracker
from relax_bus.worker import Delivery, Worker, WorkerOptions
from schemas import ScoredGroup, TrainGroup, WireTensor
from workers.data.models import load_model, materialize
from workers.roles.serve import RoleContext, run_worker
from workers.training.shared_prompt import grouped_logprobs
from workers.weights import make_transport

log = get_logger(__name__)


async def serve(ctx: RoleContext) -> None:
    """`relax worker reference`."""
    await run_worker(ctx, await reference_worker(ctx.connected, ctx.cache))


async def reference_worker(bus: Bus, cache_dir: Path, options: WorkerOptions | None = None) -> Worker[ScoredGroup]:
    """A Worker that adds reference log-probs to scored groups, with the v0 weights loaded."""
    cfg = bus.config
    model_dir = await asyncio.to_thread(materialize, cfg.model.source, cache_dir / "base", cfg.model.seed)
    model = await asyncio.to_thread(load_model, model_dir)
    tracker = await VersionTracker(bus.version).start()
    log.info("reference_waiting_for_v0")
    await tracker.wait_for(0)  # the actor publishes v0 after its warm-up
    await tracker.stop()
    state = await make_transport(bus).fetch(0)
    model.load_state_dict(state)
    model.eval()
    log.info("reference_ready", model=str(model_dir))
    temperature = cfg.rollout.temperature

    def compute(group: ScoredGroup) -> TrainGroup:
        rollout = group.rollout
        prompt = list(rollout.prompt_token_ids.to_values())
        responses = [list(s.token_ids.to_values()) for s in rollout.samples]
        with torch.no_grad():  # the prompt once, its key/value cache shared by the group's responses
            logps = grouped_logprobs(model, [prompt], responses, [0] * len(responses), temperature)
        rows = zip(logps, responses, strict=True)
        tensors = tuple(WireTensor.from_values(lp[: len(r)].tolist(), "float32") for lp, r in rows)
        return TrainGroup(scored=group, ref_logprobs=tensors)

    async def handle(group: ScoredGroup, delivery: Delivery) -> TrainGroup:
        return await asyncio.to_thread(compute, group)

    return Worker(bus, "reference", handle, ScoredGroup, options or WorkerOptions(concurrency=1))

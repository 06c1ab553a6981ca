"""The teacher role: the teacher model's log-probs of every token the student sampled (on-policy distillation).

In the chain only in a run with a `teacher` section: scored -> teacher -> train, or scored -> reference -> teach ->
teacher -> train when a KL term puts the reference role before it. It is the reference role's work on another model:
the same grouped forward (`workers.roles.reference.replayed_logprobs`: the prompt forwarded once, its key/value cache
shared by the group's responses) at the rollout's temperature, so the teacher's log-probs sit on the scale of the
sampling policy's. The differences: its weights are the teacher's own, loaded once from `teacher.source` (no policy
version to wait for), never routed as the rollout's experts were, and they go to `TrainGroup.teacher_logprobs`.
The trainer turns them into per-token advantages (`workers.training.distill`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from relax_bus.bus import Bus
from relax_bus.control import Reject
from relax_bus.log import get_logger
from relax_bus.worker import Delivery, Worker, WorkerOptions
from schemas import ScoredGroup, TrainGroup, WireTensor
from workers.data.models import load_model, materialize
from workers.omni.media_refs import has_media
from workers.roles.reference import replayed_logprobs
from workers.roles.serve import RoleContext, run_worker

log = get_logger(__name__)


async def serve(ctx: RoleContext) -> None:
    """`relax worker teacher`."""
    await run_worker(ctx, await teacher_worker(ctx.connected, ctx.cache))


async def teacher_worker(
    bus: Bus, cache_dir: Path, options: WorkerOptions | None = None
) -> Worker[ScoredGroup] | Worker[TrainGroup]:
    """A Worker that adds the teacher's log-probs to the groups of its input hop."""
    cfg = bus.config
    if cfg.teacher is None:
        raise ValueError("the run has no teacher section")
    model_dir = await asyncio.to_thread(materialize, cfg.teacher.source, cache_dir / "teacher", cfg.teacher.seed)
    model = await asyncio.to_thread(load_model, model_dir)
    model.eval()
    log.info("teacher_ready", model=str(model_dir))
    temperature = cfg.rollout.temperature

    def compute(group: ScoredGroup | TrainGroup) -> TrainGroup:
        train = group if isinstance(group, TrainGroup) else TrainGroup(scored=group)
        if has_media(train.prompt.parts):
            raise Reject("a teacher scores text prompts only; this prompt carries media")
        with torch.no_grad():
            logps = replayed_logprobs(model, train.scored.rollout, temperature, replay=False)
        tensors = tuple(WireTensor.from_values(lp.tolist(), "float32") for lp in logps)
        return train.model_copy(update={"teacher_logprobs": tensors})

    async def handle(group: ScoredGroup | TrainGroup, delivery: Delivery) -> TrainGroup:
        return await asyncio.to_thread(compute, group)

    # Its input is the reference's output (train groups) when the run has one, else the reward's (scored groups).
    opts = options or WorkerOptions(concurrency=1)
    if bus.topology.role("teacher").input == "scored":
        return Worker(bus, "teacher", handle, ScoredGroup, opts)
    return Worker(bus, "teacher", handle, TrainGroup, opts)

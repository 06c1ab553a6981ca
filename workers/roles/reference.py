"""The reference role: log-probs of every sampled response under the initial policy (version 0).

In a LoRA run (`trainer.lora`) the reference is the base with the adapter off: this role loads v0's base tensors
only and never updates, so the actor keeps one model and spends no forward on the reference.

In the chain only when `trainer.kl.coef > 0`: scored -> reference -> train. An MoE reference under
`trainer.moe.routing_replay: r3` is forced to the experts the rollout engine routed each token to, as the trainer is.
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch import nn

from relax_bus.bus import Bus
from relax_bus.control import Reject
from relax_bus.log import get_logger
from relax_bus.policy_version import VersionTracker
from relax_bus.worker import Delivery, Worker, WorkerOptions
from schemas import RolloutGroup, ScoredGroup, TrainGroup, WireTensor
from workers.data.models import load_model, materialize
from workers.moe.routing import replaying, routers
from workers.roles.serve import RoleContext, run_worker
from workers.training.batch import routed_experts
from workers.training.routing_replay import grouped_plan
from workers.training.shared_prompt import grouped_logprobs
from workers.weights import make_transport
from workers.weights.adapter import split

log = get_logger(__name__)


def replayed_logprobs(model: nn.Module, rollout: RolloutGroup, temperature: float, replay: bool) -> list[torch.Tensor]:
    """Each sample's response log-probs under `model`, the prompt forwarded once and its key/value cache shared by
    the group's responses; with `replay`, forced to the experts the rollout engine routed each token to (R3)."""
    prompt = list(rollout.prompt_token_ids.to_values())
    responses = [list(s.token_ids.to_values()) for s in rollout.samples]
    forced: AbstractContextManager[object] = nullcontext()
    if replay:
        routes = [routed_experts(s.routed_experts) for s in rollout.samples]
        if any(r is None for r in routes):
            raise Reject("a sample carries no routed experts, which the MoE reference replays under r3")
        lengths = [len(r) for r in responses]
        forced = replaying(model, grouped_plan(routes, [len(prompt)] * len(routes), lengths, [0]))  # type: ignore[arg-type]
    with forced:
        logps = grouped_logprobs(model, [prompt], responses, [0] * len(responses), temperature)
    return [lp[: len(r)] for lp, r in zip(logps, responses, strict=True)]


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
    state = await make_transport(bus).read(0)
    if cfg.trainer.lora is not None:  # the base alone: the KL is to the base with the adapter off (no second model)
        state, _ = split(state)
    model.load_state_dict(state)
    model.eval()
    log.info("reference_ready", model=str(model_dir))
    temperature = cfg.rollout.temperature
    replay = cfg.trainer.moe.routing_replay == "r3" and bool(
        routers(model)
    )  # an MoE reference takes the rollout's routing

    def compute(group: ScoredGroup) -> TrainGroup:
        with torch.no_grad():
            logps = replayed_logprobs(model, group.rollout, temperature, replay)
        tensors = tuple(WireTensor.from_values(lp.tolist(), "float32") for lp in logps)
        return TrainGroup(scored=group, ref_logprobs=tensors)

    async def handle(group: ScoredGroup, delivery: Delivery) -> TrainGroup:
        return await asyncio.to_thread(compute, group)

    return Worker(bus, "reference", handle, ScoredGroup, options or WorkerOptions(concurrency=1))

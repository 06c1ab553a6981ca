"""Routing of mixture-of-experts policies: record the experts each token went to, and force them in a later forward.

Every transformers MoE router of this generation is a `*TopKRouter` module (`model.layers[i].mlp.gate` in
Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral and their VL/Omni kin) whose forward takes the flattened hidden states
[N, H] and returns `(router_logits [N, E], router_scores [N, k], router_indices [N, k])`. One forward hook per
router is all either direction needs:

    record   indices[call][layer] = router_indices                                  # [N, k] per layer
    replay   ids    = where(forced >= 0, forced, router_indices)                    # [N, k]
             scores = softmax(router_logits).gather(ids), or softmax(router_logits.gather(ids)) for a router
                      that renormalises over its k (the same numbers, without the softmax over every expert)

The replayed scores are re-gathered from the current softmax, so the router still receives gradients through
the experts it was forced to, as it does through the ones it picks itself. A model forward is one "call": the
first router's hook opens it. Positions with a negative forced id (padding, the last token of a sequence, which
generation never fed back) keep the router's own choice.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

ROUTER_SUFFIX = "TopKRouter"


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers in layer order; empty for a dense model."""
    return [m for m in model.modules() if type(m).__name__.endswith(ROUTER_SUFFIX)]


def routing_shape(model: nn.Module) -> tuple[int, int, int]:
    """(MoE layers, experts per token, experts per layer) of an MoE model; ValueError for a dense one."""
    found = routers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no *{ROUTER_SUFFIX} modules: routing replay needs an MoE model")
    first = found[0]
    return len(found), int(first.top_k), int(first.num_experts)


def id_dtype(experts: int) -> torch.dtype:
    """The smallest integer type the wire carries expert ids in: uint8 up to 256 experts, else int16."""
    return torch.uint8 if experts <= 256 else torch.int16


class _Hooks:
    """Forward hooks on every router, removed on exit; `layer_of` maps a router to its layer index."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no *{ROUTER_SUFFIX} modules: nothing to record or replay")
        self.layer_of = {id(r): i for i, r in enumerate(self.routers)}
        self._handles: list[Any] = []

    def attach(self) -> None:
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        raise NotImplementedError


class RoutingRecorder(_Hooks):
    """Records the experts every router chose, per model forward call: `calls[c]` is [N, layers, k] long."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._layers: list[list[torch.Tensor]] = []

    @property
    def calls(self) -> list[torch.Tensor]:
        """One [N, layers, k] tensor per forward call, N the call's tokens (batch x sequence, row-major)."""
        return [torch.stack(layers, dim=1) for layers in self._layers if len(layers) == len(self.routers)]

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        layer = self.layer_of[id(module)]
        if layer == 0:
            self._layers.append([])
        self._layers[-1].append(output[2].detach())


class RoutingReplayer(_Hooks):
    """Forces the experts of `plan[c]` ([N, layers, k], -1 where the router chooses) in the model's c-th call."""

    def __init__(self, model: nn.Module, plan: Sequence[torch.Tensor], count_agreement: bool = True) -> None:
        super().__init__(model)
        self.plan = list(plan)
        self.count_agreement = count_agreement
        self._call = -1
        self.agree = 0.0
        """Forced (token, layer) choices whose expert set the router itself would have picked."""
        self.forced = 0.0
        """Forced (token, layer) choices in all."""

    @property
    def replayed_calls(self) -> int:
        """Forward calls of the model forced so far."""
        return self._call + 1

    def _hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        layer = self.layer_of[id(module)]
        if layer == 0:
            self._call += 1
        if self._call >= len(self.plan):
            raise RuntimeError(f"routing replay planned {len(self.plan)} forward calls, the model made more")
        logits, scores, own = output
        forced = self.plan[self._call][:, layer].to(own.device)  # [N, k]
        if forced.shape != own.shape:
            raise ValueError(
                f"layer {layer}: forced routing {tuple(forced.shape)} for a router output {tuple(own.shape)}"
            )
        pinned = (forced >= 0).all(-1)  # [N]
        ids = torch.where(pinned.unsqueeze(-1), forced.long(), own)  # [N, k]
        if self.count_agreement:
            same = (ids.sort(-1).values == own.sort(-1).values).all(-1) & pinned  # [N]
            self.agree += float(same.sum())
            self.forced += float(pinned.sum())
        if getattr(module, "norm_topk_prob", True):  # Mixtral has no flag: it always renormalises
            # softmax over all experts, renormalised over the k chosen = softmax over the k chosen logits
            probs = torch.softmax(logits.float().gather(-1, ids), dim=-1)  # [N, k]
        else:
            probs = torch.softmax(logits.float(), dim=-1).gather(-1, ids)  # [N, k]
        return logits, probs.to(scores.dtype), ids


@contextmanager
def recording(model: nn.Module) -> Iterator[RoutingRecorder]:
    """Record the routing of every forward call inside the block."""
    recorder = RoutingRecorder(model)
    recorder.attach()
    try:
        yield recorder
    finally:
        recorder.detach()


@contextmanager
def replaying(
    model: nn.Module, plan: Sequence[torch.Tensor], count_agreement: bool = True
) -> Iterator[RoutingReplayer]:
    """Force `plan[c]` in the c-th forward call inside the block (and count agreement, unless told not to)."""
    replayer = RoutingReplayer(model, plan, count_agreement)
    replayer.attach()
    try:
        yield replayer
    finally:
        replayer.detach()

"""How the trainer's ranks share a step: one process, or FSDP2 across torchrun's ranks. Chosen once, when the
trainer is built (`ranks_for`), so the step itself never asks which.

                 one process                    FSDP2 (`trainer.distributed.nproc` > 1)
    model        as loaded                      every decoder layer and the whole model `fully_shard`ed
    rows         all of each mini-batch         this rank's even share (`split_even`)
    passes       as many as the micro-batches   padded with empty forwards to the most any rank has
    sums         as they are                    all-reduced (SUM, or MAX for maxima)
    precision    autocast to the compute dtype  FSDP2's mixed-precision policy casts
    state dict   the module's own               gathered on rank 0 (a collective)

The loss of each rank is normalised over the whole mini-batch (the all-reduced token count), and FSDP2 averages
gradients over ranks, so `loss_scale` (the world size) makes tokens weigh as in one process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from workers.checkpoints.whole import FULL
from workers.training.devices import autocast
from workers.training.microbatch import split_even


class OneProcess:
    """The whole step in this process."""

    rank = 0
    world = 1

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype

    def shard(self, model: torch.nn.Module) -> None:
        """Nothing to shard."""

    def autocast(self) -> Any:
        """The precision context of a forward pass."""
        return autocast(self.device, self.dtype, enabled=True)

    def share(self, rows: range) -> list[int]:
        """This rank's rows of a mini-batch: all of them."""
        return list(rows)

    def most(self, count: int) -> int:
        """The most micro-batches any rank has: this one's."""
        return count

    def sum(self, values: list[float]) -> list[float]:
        """`values` summed over the ranks."""
        return values

    def max(self, values: list[float]) -> list[float]:
        """`values`' maxima over the ranks."""
        return values

    @property
    def loss_scale(self) -> float:
        """What each micro-batch's loss is multiplied by before its backward."""
        return float(self.world)

    def empty_passes(self, model: torch.nn.Module, count: int, backward: bool) -> None:
        """Nothing to pad (`count` is always 0 here)."""

    def full_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model on CPU: an unsharded module names the same tensors itself (~5x faster than gathering)."""
        return {k: v.cpu() for k, v in model.state_dict().items()}

    def load_full(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a full (unsharded) state dict."""
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    def scalar(self, value: torch.Tensor) -> float:
        """A reduced tensor (the gradient norm) as a float."""
        return float(value)


class Fsdp2Ranks(OneProcess):
    """This rank of a torchrun world: the model sharded by FSDP2, each rank its share of every mini-batch."""

    def __init__(self, device: torch.device, dtype: torch.dtype, rank: int, world: int) -> None:
        super().__init__(device, dtype)
        self.rank = rank
        self.world = world

    def shard(self, model: torch.nn.Module) -> None:
        """`fully_shard` every decoder layer, then the whole model, under the compute dtype's mixed precision."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        for layer in model.model.layers:  # type: ignore[union-attr]
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)

    def autocast(self) -> Any:
        """No autocast: FSDP2 casts by its policy."""
        return autocast(self.device, self.dtype, enabled=False)

    def share(self, rows: range) -> list[int]:
        """This rank's even share of a mini-batch's rows."""
        share = split_even(len(rows), self.world)[self.rank]
        return list(rows)[share.start : share.stop]

    def most(self, count: int) -> int:
        """The most micro-batches any rank has (a collective)."""
        return int(self.max([float(count)])[0])

    def sum(self, values: list[float]) -> list[float]:
        """`values` summed over the ranks (a collective)."""
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        """`values`' maxima over the ranks (a collective)."""
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def empty_passes(self, model: torch.nn.Module, count: int, backward: bool) -> None:
        """Forwards (and backwards) that change nothing: FSDP2's collectives need every rank in every pass."""
        for _ in range(count):
            ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
            with self.autocast():
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
            if backward:
                (logits.float().sum() * 0.0).backward()

    def full_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model on CPU (a collective: every rank calls it; rank 0 gets the tensors)."""
        return {k: v.cpu() for k, v in get_model_state_dict(model, options=FULL).items()}

    def load_full(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict that rank 0 holds into every rank's shards (a collective)."""
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, state, options=options)

    def scalar(self, value: torch.Tensor) -> float:
        """A DTensor's whole value as a float."""
        return float(value.full_tensor() if hasattr(value, "full_tensor") else value)

    def _all_reduce(self, values: list[float], op: Any) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=op)
        return [float(v) for v in tensor.cpu()]


def ranks_for(device: torch.device, dtype: torch.dtype) -> OneProcess:
    """The ranks of this process: FSDP2 under a torchrun world of several, else one process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return Fsdp2Ranks(device, dtype, dist.get_rank(), dist.get_world_size())
    return OneProcess(device, dtype)

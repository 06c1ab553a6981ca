"""What a weight transport is: it moves full state dicts by policy version."""

from __future__ import annotations

from typing import Protocol

import torch

from schemas import WeightsAnnouncement

StateDict = dict[str, torch.Tensor]


class WeightTransport(Protocol):
    """Moves full state dicts by policy version."""

    async def publish(self, version: int, state: StateDict, step: int) -> WeightsAnnouncement: ...

    async def read(self, version: int) -> StateDict: ...

    async def expect(self, version: int) -> None:
        """A hint: `version` is the one this reader expects to read next (a transport may start on it now)."""

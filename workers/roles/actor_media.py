"""The actor's media: processor tensors of the groups it holds, and the per-modality metrics of a step.

A multimodal policy's trainer scores each media prompt with the processor's tensors. The actor computes them
when it admits a group, while the step is still collecting (not inside the step): payloads are read from the
media store by digest (once per process, `PayloadCache`), the processor runs in a thread, and its expanded
prompt ids must equal the ids the rollout engine sampled after, or the group is dead-lettered (the two sides
would score different sequences). Media that cannot be read or decoded dead-letters only its group.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from relax_bus.blobs import BlobStore
from relax_bus.control import Reject
from schemas import TrainGroup
from workers.engines.base import MediaInputs
from workers.omni.errors import MediaError
from workers.omni.media_refs import PayloadCache, has_media, media_bytes, modality


class ActorMedia:
    """Processor tensors of held groups by release index, and what the step's media cost."""

    def __init__(self, prompter: Any, store: BlobStore) -> None:
        self.prompter = prompter
        self.payloads = PayloadCache(store, root=getattr(prompter, "media_root", None))
        self.held: dict[int, MediaInputs] = {}
        self._seconds = 0.0
        self._bytes = 0

    async def admit(self, group: TrainGroup) -> None:
        """Compute and keep the tensors of a group the step holds (a media prompt only); Reject media that cannot
        be used."""
        prompt = group.prompt
        if self.prompter is None or not has_media(prompt.parts):
            return
        try:
            payloads = await self.payloads.payloads(prompt.parts)
            before = self.prompter.seconds
            inputs = await asyncio.to_thread(self.prompter.inputs, prompt.parts, payloads)
        except MediaError as err:
            raise Reject(f"group {group.group_id}: prompt media cannot be used: {err}") from None
        self._seconds += self.prompter.seconds - before
        self._bytes += media_bytes(prompt.parts)
        if inputs["input_ids"][0].tolist() != list(group.scored.rollout.prompt_token_ids.to_values()):
            raise Reject(f"group {group.group_id}: the rollout's prompt ids are not the processor's for its media")
        self.held[prompt.release_index] = inputs

    def take(self, groups: Sequence[TrainGroup]) -> list[MediaInputs | None]:
        """The tensors of the step's groups, in order (None for a text prompt), no longer held."""
        return [self.held.pop(g.prompt.release_index, None) for g in groups]

    def metrics(self, groups: Sequence[TrainGroup]) -> dict[str, float]:
        """`reward/<modality>` means of the step's groups, media bytes and processor seconds since the last call;
        nothing for a run without media."""
        by_modality: dict[str, list[float]] = defaultdict(list)
        for g in groups:
            by_modality[modality(g.prompt.parts)].extend(g.scored.rewards)
        if set(by_modality) <= {"text"}:
            return {}
        out = {f"reward/{name}": statistics.fmean(values) for name, values in sorted(by_modality.items())}
        out["media_bytes"], out["processor_s"] = float(self._bytes), self._seconds
        self._bytes, self._seconds = 0, 0.0
        return out

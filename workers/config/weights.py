"""How weights reach the engines: one model per weight transport."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from workers.config.base import Section, shorthand


class ObjectStoreWeights(Section):
    """Weights as one safetensors object per version in the run's `weights` object store (no shared disk)."""

    type: Literal["object_store"] = "object_store"


class FilesystemWeights(Section):
    """Weights as `<root>/<run>/v<version>.safetensors` on a filesystem every trainer, rollout and
    reference process mounts at the same path (NFS, a shared volume, one machine)."""

    type: Literal["filesystem"]
    root: str = Field(min_length=1)
    """Directory shared by every process of the run."""


class ShmWeights(Section):
    """Weights as safetensors segments in shared memory, `<dir>/relax-<uid>/<run>/v<version>.safetensors`,
    mapped by the engines without a copy: only for a trainer, rollout and reference processes on one host
    under one uid."""

    type: Literal["shm"]
    dir: str = Field(default="/dev/shm", min_length=1)
    """A tmpfs (RAM-backed) directory; the segments go into a `relax-<uid>` folder in it only this uid can write."""


WeightsConfig = Annotated[
    ObjectStoreWeights | FilesystemWeights | ShmWeights, Field(discriminator="type"), BeforeValidator(shorthand)
]

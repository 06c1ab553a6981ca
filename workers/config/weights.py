"""How weights reach the engines: one model per weight transport."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from workers.config.base import Section, shorthand


class _Weights(Section):
    """What every weight transport takes: how many bytes a version puts on it (`workers.weights.wire`)."""

    delta: bool = False
    """From v1 on, send only the tensors whose bytes differ from v0's (frozen or untouched ones are taken from each
    reader's copy of v0, checked by digest); each reader then holds one extra copy of v0."""
    wire_dtype: Literal["float32", "bfloat16"] = "float32"
    """`bfloat16`: float32 tensors of v1 on travel as bfloat16 (half the bytes; the engines sample with weights
    rounded to bfloat16, which the off-policy correction sees as mismatch); v0 stays exact."""


class ObjectStoreWeights(_Weights):
    """Weights as one safetensors object per version in the run's `weights` object store (no shared disk)."""

    type: Literal["object_store"] = "object_store"
    stream: bool = True
    """A rollout worker follows the upload of the version it will load next while the trainer writes it, so the
    fetch its announcement triggers waits only for the last chunks. Costs the worker a second copy of the weights
    in memory and the CPU to receive them while it generates (on 2 shared cores measured no faster: it is for
    hosts where the reader has cores or a network link of its own)."""


class FilesystemWeights(_Weights):
    """Weights as `<root>/<run>/v<version>.safetensors` on a filesystem every trainer, rollout and
    reference process mounts at the same path (NFS, a shared volume, one machine)."""

    type: Literal["filesystem"]
    root: str = Field(min_length=1)
    """Directory shared by every process of the run."""
    verify: bool = True
    """Check each fetched file against the SHA-256 its publisher wrote into it (shared storage can serve a truncated
    or damaged file); a mismatch is refused."""


class ShmWeights(_Weights):
    """Weights as safetensors segments in shared memory, `<dir>/relax-<uid>/<run>/v<version>.safetensors`,
    mapped by the engines without a copy: only for a trainer, rollout and reference processes on one host
    under one uid."""

    type: Literal["shm"]
    dir: str = Field(default="/dev/shm", min_length=1)
    """A tmpfs (RAM-backed) directory; the segments go into a `relax-<uid>` folder in it only this uid can write."""
    verify: bool = False
    """Check each mapped segment against the SHA-256 its publisher wrote into it: one pass over the segment per
    fetch, about as long as the fetch itself (off by default: a segment never leaves this host's memory and uid)."""


class BroadcastWeights(_Weights):
    """Weights pushed by the trainer to every rollout engine over a torch.distributed gloo group, and put into the
    object store too (readers that join late, miss a round or restart read them there; the reference role
    always does). Rendezvous: the trainer's TCPStore, named in the run's state KV under `weights.broadcast`.
    No authentication on that port: only for a network where every host that reaches it is trusted."""

    type: Literal["broadcast"]
    host: str = Field(default="127.0.0.1", min_length=1)
    """The trainer's address as readers reach it; its rendezvous store listens there. `127.0.0.1` keeps the
    whole group on the loopback (one host); otherwise every process's gloo pairs use its own hostname."""
    port: int = Field(default=0, ge=0, le=65535)
    """The rendezvous store's port (0: any free one, named in the KV)."""
    bucket_mb: int = Field(default=64, ge=1)
    """Tensors travel packed in buckets of about this size, one broadcast each (a larger tensor goes alone)."""
    timeout_s: float = Field(default=30.0, gt=0)
    """How long a round waits for a member (its group's rendezvous and each broadcast), and how long a reader may
    go without a beat before rounds leave it out. A member that dies inside a round costs that round this long."""
    verify: bool = False
    """Send a SHA-256 per bucket and check it on receipt (a mismatch: that version comes from the object store)."""


WeightsConfig = Annotated[
    ObjectStoreWeights | FilesystemWeights | ShmWeights | BroadcastWeights,
    Field(discriminator="type"),
    BeforeValidator(shorthand),
]

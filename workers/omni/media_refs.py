"""Media by reference on the bus: each payload stored once by content digest, read once per process.

The feeder stores each inline media payload once in the run's media object store under its content digest
and releases the part as a reference (`by_reference`, a pure function: the reward role recomputes it to
check a prompt against the task's release). Every sample of the group, every epoch and every role then
refers to the same object. A rollout worker and the actor read payloads through a `PayloadCache` (one fetch
per digest per process). A `file://` reference is read only inside the run's media root (the jsonl task's
directory, `workers.data.jsonl_task.read_inside`): a message cannot make a worker read `/dev/zero` or a file out
of it. Nothing here imports the media stack (torch, PIL, soundfile).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlparse

from relax_bus.blobs import BlobStore
from relax_bus.errors import BlobCorrupt, BlobNotFound
from schemas.parts import MediaRef, Part, TextPart
from workers.data.jsonl_task import read_inside
from workers.omni.errors import MediaError


def has_media(parts: Sequence[Part]) -> bool:
    """True when a prompt carries at least one image, audio or video part."""
    return any(not isinstance(p, TextPart) for p in parts)


def modality(parts: Sequence[Part]) -> str:
    """The prompt's modality for per-modality metrics: `text`, `image`, `audio`, `video`, or `omni` for several."""
    kinds = {p.type for p in parts if not isinstance(p, TextPart)}
    if not kinds:
        return "text"
    return kinds.pop() if len(kinds) == 1 else "omni"


def by_reference(parts: Sequence[Part]) -> tuple[Part, ...]:
    """`parts` with every inline media payload replaced by a reference to its content digest in the media store."""
    out: list[Part] = []
    for part in parts:
        if isinstance(part, TextPart) or part.inline is None:
            out.append(part)
            continue
        ref = MediaRef(digest="sha256:" + hashlib.sha256(part.inline).hexdigest(), size=len(part.inline))
        out.append(type(part).model_validate({**part.model_dump(), "inline": None, "ref": ref}))
    return tuple(out)


async def store_inline(store: BlobStore, parts: Sequence[Part]) -> tuple[Part, ...]:
    """Put each inline payload into `store` under its digest (a no-op when it is there); return `by_reference`."""
    for part in parts:
        if not isinstance(part, TextPart) and part.inline is not None:
            await store.put_content(part.inline)
    return by_reference(parts)


def media_bytes(parts: Sequence[Part]) -> int:
    """Payload bytes a prompt's media parts carry inline or declare in their references."""
    total = 0
    for p in parts:
        if isinstance(p, TextPart):
            continue
        total += len(p.inline) if p.inline is not None else (p.ref.size or 0) if p.ref is not None else 0
    return total


class PayloadCache:
    """Media payloads by reference, read from the media store (or a local file under `root`) once per process,
    LRU-bounded."""

    def __init__(self, store: BlobStore, max_bytes: int = 256 << 20, root: Path | None = None) -> None:
        self.store = store
        self.root = root
        """The one directory `file://` references are read from (`workers.data.jsonl_task.task_media_root`); None:
        none is read."""
        self.max_bytes = max_bytes
        self._held: OrderedDict[MediaRef, bytes] = OrderedDict()
        self._size = 0
        self.fetched_bytes = 0
        """Bytes read from the store or disk since the start (cache misses only)."""

    def __contains__(self, ref: object) -> bool:
        """True when `ref`'s payload is held (read before, not evicted since)."""
        return ref in self._held

    async def payloads(self, parts: Sequence[Part]) -> dict[MediaRef, bytes]:
        """The bytes of every referenced payload of `parts`; MediaError names one that cannot be read."""
        out: dict[MediaRef, bytes] = {}
        for i, part in enumerate(parts):
            if isinstance(part, TextPart) or part.ref is None:
                continue
            try:
                out[part.ref] = await self._get(part.ref)
            except (BlobNotFound, BlobCorrupt, OSError, MediaError) as err:
                raise MediaError(f"prompt part {i} ({part.type}): {part.ref.digest or part.ref.uri}: {err}") from None
        return out

    async def _get(self, ref: MediaRef) -> bytes:
        if ref in self._held:
            self._held.move_to_end(ref)
            return self._held[ref]
        if ref.digest is not None:
            data = await self.store.get_content(ref.digest)
        else:
            data = read_uri(ref.uri or "", self.root)
        self.fetched_bytes += len(data)
        self._held[ref] = data
        self._size += len(data)
        while self._size > self.max_bytes and len(self._held) > 1:
            _, dropped = self._held.popitem(last=False)
            self._size -= len(dropped)
        return data


def read_uri(uri: str, root: Path | None) -> bytes:
    """The bytes of a `file://` URI (or a plain path) naming a regular file inside `root`; MediaError for any other
    scheme, and for a file out of `root` or not regular (`read_inside`)."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("file", ""):
        raise MediaError(f"media URI scheme {parsed.scheme!r} cannot be read here (only file://): {uri}")
    try:
        return read_inside(uri_path(uri), root)
    except ValueError as err:
        raise MediaError(str(err)) from None


def uri_path(uri: str) -> Path:
    """The local path of a `file://` URI (or a plain path)."""
    return Path(unquote(urlparse(uri).path))

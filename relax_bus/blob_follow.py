"""Reading an object while it is being written: a reader that starts before the writer.

A writer that names its uploads `<prefix>.<id>` (`BlobStore.put(..., nuid=...)`, a fresh id per attempt) lets
a reader subscribe to the chunk subjects `$O.<bucket>.C.<prefix>.*` before the upload starts and receive each
chunk soon after it is stored, instead of after the object's info record is written. It reads by direct get
(roles create no consumers, `relax_bus.direct_get`), from the first stored chunk of any such upload on, asking
again every `POLL_S` while nothing new is stored: a reader told late still gets the chunks stored before.
`ChunkFollower` keeps the chunks of the newest upload it has seen (another id, e.g. a writer restarted after a
crash, starts it over), hashing them as they arrive. Once the object is complete (its info record read),
`take(info)` waits for that upload's last chunk and returns the object in one buffer, verified against the
record's digest. It returns None, and the caller fetches the object as usual, when the follower never saw that
upload, when the chunks stop coming, or when they do not hash to the record: the record decides, never the stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap

import nats.errors
from nats.js import JetStreamContext, api
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE

from relax_bus.blobs import CHUNKS_PER_READ, HASHER, matches_record
from relax_bus.cancel import cancel_and_wait
from relax_bus.direct_get import read_batch
from relax_bus.log import get_logger

log = get_logger(__name__)

POLL_S = 0.05
"""How often a follower asks again while no new chunk is stored."""


class ChunkFollower:
    """Follows the uploads named `<prefix>.<id>` in one object store, keeping the newest one's chunks."""

    def __init__(self, js: JetStreamContext, bucket: str, stream: str, prefix: str) -> None:
        self.js = js
        self.bucket = bucket
        self.stream = stream
        self.prefix = prefix
        self.subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=f"{prefix}.*")
        self.upload: str | None = None
        """The nuid (`<prefix>.<id>`) of the upload whose chunks are kept."""
        self.chunks: list[bytes] = []
        self._sha = hashlib.sha256()
        self._hashed: list[asyncio.Future[None]] = []
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start reading the chunks stored from the first one of any such upload on, in the background."""
        self._task = asyncio.create_task(self._read(), name=f"follow-{self.prefix}")

    async def _read(self) -> None:
        nc, seq = self.js._nc, 1
        while True:
            got = 0
            try:
                async for stored in read_batch(nc, self.stream, self.subject, from_seq=seq, batch=CHUNKS_PER_READ):
                    got += 1
                    seq = stored.seq + 1
                    self._on_chunk(stored.subject, stored.data)
            except (nats.errors.Error, OSError) as err:
                log.info("follow_read_failed", object=self.prefix, error=type(err).__name__)  # tolerated: again
            if not got:
                await asyncio.sleep(POLL_S)

    def _on_chunk(self, subject: str, data: bytes) -> None:
        if not data:
            return  # a rollup marker: the chunks of a failed or deleted upload were cleared
        upload = subject.removeprefix(OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=""))
        if upload != self.upload:
            self.upload, self.chunks, self._sha, self._hashed = upload, [], hashlib.sha256(), []
        self.chunks.append(data)
        loop = asyncio.get_running_loop()
        self._hashed.append(loop.run_in_executor(HASHER, self._sha.update, data))
        self._arrived.set()

    async def take(self, info: api.ObjectInfo, stall_s: float) -> memoryview | None:
        """The complete object `info` describes, if this follower has (or gets, each chunk within `stall_s`)
        all of its chunks and they hash to its record; None otherwise."""
        want = info.chunks or 0
        if not (info.nuid or "").startswith(self.prefix + "."):
            return None
        while self.upload != info.nuid or len(self.chunks) < want:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), stall_s)
            except TimeoutError:
                log.info("follow_stalled", object=info.name, upload=info.nuid, following=self.upload)
                return None
        chunks, sha, hashed = self.chunks, self._sha, list(self._hashed)
        await asyncio.gather(*hashed)
        size = sum(len(c) for c in chunks)
        if len(chunks) != want or size != (info.size or 0) or not matches_record(info, sha):
            log.warning("follow_mismatch", object=info.name, upload=info.nuid, size=size, recorded_size=info.size)
            return None
        buf = memoryview(mmap.mmap(-1, size) if size else bytearray())
        offset = 0
        for i, c in enumerate(chunks):
            buf[offset : offset + len(c)] = c
            offset += len(c)
            chunks[i] = b""  # freed as copied: the object is in memory about once, not twice
        return buf

    async def close(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        await asyncio.gather(*self._hashed, return_exceptions=True)
        self.chunks = []

"""Blobs in a JetStream object store: content-addressed put and a fast chunked get.

Objects are written in the standard object-store layout (chunks on `$O.<bucket>.C.<nuid>`, a JSON
info record on `$O.<bucket>.M.<name>`), so `nats object ls/get` from the NATS CLI reads them too.
Both directions are our own: the stock nats-py `get` concatenates bytes quadratically (~7 MiB/s at
64 MiB) and the stock `put` waits for every chunk's ack in turn. Here chunks are published with a
window of outstanding acks and read back by direct get (`relax_bus.direct_get`), hashed as they arrive; a
reader that can view the bytes in place (the weights transport) gets them in one preallocated buffer.

A store is bounded (`max_bytes`, discard=new): a put that does not fit fails with `PublishFailed`
naming the setting to raise, and leaves none of its chunks behind. Chunks of a deleted, replaced or
failed object are removed with a rollup marker on their subject (one empty message), which needs only
the permission to write the store, not the stream purge API.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import mmap
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DIGEST_TEMPLATE,
    OBJ_DIGEST_TYPE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
)

from relax_bus.direct_get import last_per_subject, read_all
from relax_bus.errors import AcksLost, BlobCorrupt, BlobNotFound, PublishFailed

MAX_CHUNK = 1 << 20
WINDOW = 16
ACK_TIMEOUT_S = 10.0
STORE_FULL = 10077  # JetStream err_code: maximum bytes exceeded (the store is bounded with discard=new)
CHUNKS_PER_READ = 16
"""Chunks asked for in one direct get: up to 16 MiB answered at once, the next request sent after them."""
HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blob-sha256")
"""Where chunks are hashed: one thread, so the chunks of an object hash in order."""


def digest_of(data: bytes | memoryview) -> str:
    """`sha256:<hex>` of a payload: the address of a content-addressed blob."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def matches_record(info: api.ObjectInfo, sha: Any) -> bool:
    """Whether `sha` (a hashlib sha256 of the bytes read) is the digest the object's info record names (a record
    naming none is not checked)."""
    recorded = (info.digest or "").removeprefix(OBJ_DIGEST_TYPE).rstrip("=")
    return not recorded or recorded == base64.urlsafe_b64encode(sha.digest()).decode().rstrip("=")


def _meta_subject(bucket: str, name: str) -> str:
    return OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=base64.urlsafe_b64encode(name.encode()).decode())


class BlobStore:
    """One object-store bucket, read and written with pipelined chunks."""

    def __init__(self, js: JetStreamContext, bucket: str, max_payload: int) -> None:
        self.js = js
        self.bucket = bucket
        self.stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
        # Leave room for headers and the protocol line inside the server's max_payload.
        self.chunk_size = max(4096, min(MAX_CHUNK, max_payload - 8192))

    async def info(self, name: str) -> api.ObjectInfo | None:
        """The object's info record, or None when there is no (undeleted) object of that name."""
        try:
            msg = await self.js.get_last_msg(self.stream, _meta_subject(self.bucket, name))
        except nats.js.errors.NotFoundError:
            return None
        info = api.ObjectInfo.from_response(json.loads(msg.data or b"{}"))
        return None if info.deleted else info

    async def put_content(self, data: bytes) -> str:
        """Store `data` under its own digest (a no-op when the object there already holds it); return the digest.

        An object found under the digest is read back and checked first: whoever may write the store could
        have put other bytes under that name, and every reader of the digest would then be refused them."""
        sha = hashlib.sha256(data).digest()
        name = sha.hex()
        if await self.info(name) is not None:
            try:
                await self.get(name, sha256_hex=name)
                return "sha256:" + name
            except (BlobCorrupt, BlobNotFound):
                pass  # not what its name says (or gone meanwhile): stored afresh below
        await self.put(name, data, sha256=sha)
        return "sha256:" + name

    async def put(
        self,
        name: str,
        data: bytes | memoryview,
        headers: dict[str, str] | None = None,
        sha256: bytes | None = None,
        nuid: str | None = None,
    ) -> api.ObjectInfo:
        """Store `data` under `name`, replacing any previous object of that name.

        `sha256` is the payload's digest when the caller already computed it (saves a pass). `nuid` names the
        upload's chunk subject (unique per attempt; a reader can follow `<prefix>.*`, `relax_bus.blob_follow`).
        """
        view = memoryview(data)
        old = await self.info(name)
        nuid = nuid or self.js._nc._nuid.next().decode()
        chunk_subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=nuid)
        sha = None if sha256 is not None else hashlib.sha256()
        pending: list[tuple[asyncio.Future[api.PubAck], memoryview]] = []
        chunks = 0
        try:
            for start in range(0, len(view), self.chunk_size):
                piece = view[start : start + self.chunk_size]
                if sha is not None:
                    sha.update(piece)
                if chunks == 0:
                    # The first chunk waits for its ack: a full store refuses it at once and clearly (a refused
                    # pipelined chunk only shows as a missing ack).
                    await self._publish_chunk(chunk_subject, piece, name, len(view))
                else:
                    pending.append((await self.js.publish_async(chunk_subject, bytes(piece)), piece))
                chunks += 1
                if len(pending) >= WINDOW:
                    await self._wait_acks(chunk_subject, pending[: WINDOW // 2], name, len(view))
                    del pending[: WINDOW // 2]
            await self._wait_acks(chunk_subject, pending, name, len(view))
        except BaseException:
            await self._clear(chunk_subject)
            raise
        raw_digest = sha.digest() if sha is not None else sha256
        assert raw_digest is not None
        info = api.ObjectInfo(
            name=name,
            bucket=self.bucket,
            nuid=nuid,
            size=len(view),
            chunks=chunks,
            mtime=datetime.now(UTC).isoformat(),
            digest=OBJ_DIGEST_TEMPLATE.format(digest=base64.urlsafe_b64encode(raw_digest).decode()),
            headers=headers,
            options=api.ObjectMetaOptions(max_chunk_size=self.chunk_size),
        )
        try:
            await self.js.publish(
                _meta_subject(self.bucket, name),
                json.dumps(info.as_dict()).encode(),
                headers={api.Header.ROLLUP: "sub"},
                timeout=ACK_TIMEOUT_S,
            )
        except BaseException:
            await self._clear(chunk_subject)
            raise
        if old is not None:
            await self._clear(OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=old.nuid))
        return info

    async def get(self, name: str, timeout_s: float = 30.0, sha256_hex: str | None = None) -> bytes:
        """Fetch an object whole, verifying its digest (and that it is `sha256_hex`, when given)."""
        return b"".join([chunk async for chunk in self._chunks(name, timeout_s, want=sha256_hex)])

    async def get_buffer(self, name: str, timeout_s: float = 30.0, info: api.ObjectInfo | None = None) -> memoryview:
        """Fetch an object (described by `info` when the caller has read it) into one writable buffer, verifying
        its digest (for readers that view it in place).

        The buffer is anonymous memory (`mmap`): its pages are zeroed lazily by the kernel and touched
        once, by the copy of each chunk, instead of twice as a zero-filled bytearray would be.
        """
        info = info or await self.info_or_missing(name)
        buf = memoryview(mmap.mmap(-1, info.size) if info.size else bytearray())
        offset = 0
        async for chunk in self._chunks(name, timeout_s, info):
            buf[offset : offset + len(chunk)] = chunk  # _chunks never yields past the recorded size
            offset += len(chunk)
        return buf

    async def info_or_missing(self, name: str) -> api.ObjectInfo:
        """The object's info record; `BlobNotFound` naming the object and store when there is none."""
        info = await self.info(name)
        if info is None:
            raise BlobNotFound(f"no object {name!r} in store {self.bucket}")
        return info

    async def _chunks(
        self, name: str, timeout_s: float, info: api.ObjectInfo | None = None, want: str | None = None
    ) -> AsyncIterator[bytes]:
        """The object's chunks in order; the digest is computed as they arrive and checked after the last,
        against the object's own record and, when given, the hex sha256 `want` the caller trusts.

        Hashing runs in a helper thread (sha256 releases the GIL), in chunk order, while this task
        keeps receiving: on a large object it costs as much CPU as receiving does.
        """
        info = info or await self.info_or_missing(name)
        size, chunks = info.size or 0, info.chunks or 0
        sha = hashlib.sha256()
        hashed: list[asyncio.Future[None]] = []
        loop = asyncio.get_running_loop()
        offset = 0
        if chunks:
            subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=info.nuid)
            try:
                async for stored in read_all(
                    self.js._nc, self.stream, subject, batch=CHUNKS_PER_READ, timeout_s=timeout_s
                ):
                    offset += len(stored.data)
                    if offset > size:
                        raise BlobCorrupt(f"object {name!r} in {self.bucket}: more than the {size} bytes recorded")
                    hashed.append(loop.run_in_executor(HASHER, sha.update, stored.data))
                    yield stored.data
            except nats.errors.TimeoutError:
                raise BlobNotFound(f"object {name!r} in {self.bucket}: chunks missing after {offset} bytes") from None
            finally:
                await asyncio.gather(*hashed, return_exceptions=True)
        if offset != size:
            raise BlobCorrupt(f"object {name!r} in {self.bucket}: got {offset} bytes, expected {size}")
        if not matches_record(info, sha):
            raise BlobCorrupt(f"object {name!r} in {self.bucket}: digest mismatch")
        if want is not None and sha.hexdigest() != want:
            # The object's own record can be rewritten by whoever writes the store; the claim cannot.
            raise BlobCorrupt(f"object {name!r} in {self.bucket}: content is not the sha256 its claim names")

    async def get_content(self, digest: str) -> bytes:
        """Fetch a content-addressed blob by its `sha256:<hex>` digest, verified against that digest."""
        hex_digest = digest.removeprefix("sha256:")
        return await self.get(hex_digest, sha256_hex=hex_digest)

    async def delete(self, name: str) -> None:
        """Delete an object (a no-op when there is none): a tombstone record, then its chunks are cleared."""
        info = await self.info(name)
        if info is None:
            return
        deleted = api.ObjectInfo(name=name, bucket=self.bucket, nuid=info.nuid, size=0, chunks=0, deleted=True)
        await self.js.publish(
            _meta_subject(self.bucket, name),
            json.dumps(deleted.as_dict()).encode(),
            headers={api.Header.ROLLUP: "sub"},
            timeout=ACK_TIMEOUT_S,
        )
        await self._clear(OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=info.nuid))

    async def names(self) -> list[str]:
        """Names of the live objects in the bucket."""
        records = await last_per_subject(
            self.js._nc, self.stream, OBJ_META_PRE_TEMPLATE.format(bucket=self.bucket, obj=">")
        )
        infos = (api.ObjectInfo.from_response(json.loads(r.data or b"{}")) for r in records)
        return [i.name for i in infos if not i.deleted]

    async def clear_orphans(self) -> int:
        """Clear the chunks that no object's info record names and return how many uploads they were.

        A put cut off by SIGKILL (no `except` runs) leaves its chunks in the stream for good: a checkpoint's
        worth of bytes per crash. Only its single writer may call this, before it writes: the chunks of a
        put still in flight look the same."""
        prefix = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj="")
        chunks = await self._subjects(prefix + ">")
        if not chunks:
            return 0
        named = set()
        for subject in await self._subjects(OBJ_META_PRE_TEMPLATE.format(bucket=self.bucket, obj=">")):
            msg = await self.js.get_last_msg(self.stream, subject)
            named.add(api.ObjectInfo.from_response(json.loads(msg.data or b"{}")).nuid)
        cleared = 0
        for subject, count in chunks.items():
            if subject.removeprefix(prefix) in named:
                continue
            if count == 1 and not (await self.js.get_last_msg(self.stream, subject)).data:
                continue  # already cleared: only the rollup marker is left
            await self._clear(subject)
            cleared += 1
        return cleared

    async def _subjects(self, subjects_filter: str) -> dict[str, int]:
        """Message count per subject of the store's stream that matches the filter."""
        info = await self.js.stream_info(self.stream, subjects_filter=subjects_filter)
        return dict(info.state.subjects or {})

    async def _publish_chunk(self, subject: str, piece: memoryview, name: str, size: int) -> None:
        """Publish one chunk and wait for its ack; a full store raises PublishFailed naming the setting to raise."""
        try:
            await self.js.publish(subject, bytes(piece), timeout=ACK_TIMEOUT_S)
        except nats.errors.TimeoutError:
            raise AcksLost(f"object store {self.bucket}: chunk ack not received in {ACK_TIMEOUT_S:g}s") from None
        except nats.js.errors.APIError as err:
            if err.err_code == STORE_FULL:
                raise PublishFailed(
                    f"object store {self.bucket} is full: {name!r} ({size / (1 << 20):.1f} MiB) does not fit; "
                    f"delete objects or raise {_limit_setting(self.bucket)}"
                ) from None
            raise

    async def _wait_acks(
        self,
        subject: str,
        pending: Iterable[tuple[asyncio.Future[api.PubAck], memoryview]],
        name: str,
        size: int,
    ) -> None:
        items = list(pending)
        if not items:
            return
        # publish_async futures never resolve if the server rejects the publish: bound the wait.
        _, waiting = await asyncio.wait([fut for fut, _ in items], timeout=ACK_TIMEOUT_S)
        for fut in waiting:
            fut.cancel()  # frees its slot in the client's window of pending publishes
        for fut, _ in items:
            if fut not in waiting:
                fut.result()  # raises what the server answered instead of an ack
        if waiting:
            # Ask again for the first chunk without an ack, waiting for the answer: a full store says so. The
            # copy is harmless: the caller clears the whole chunk subject of this failed put.
            lost = next(piece for fut, piece in items if fut in waiting)
            await self._publish_chunk(subject, lost, name, size)
            raise AcksLost(f"object store {self.bucket}: chunk acks not received in {ACK_TIMEOUT_S:g}s")

    async def _clear(self, subject: str) -> None:
        """Remove every chunk on `subject`: a rollup marker replaces them (the stream purge API when even the
        marker does not fit)."""
        try:
            await self.js.publish(subject, b"", headers={api.Header.ROLLUP: "sub"}, timeout=ACK_TIMEOUT_S)
            return
        except nats.js.errors.APIError as err:
            if err.err_code != STORE_FULL:
                return  # tolerated, as below
        except Exception:  # best effort: the chunks were never announced, and a store's max age removes them
            return
        try:
            await self.js.purge_stream(self.stream, subject=subject)
        except Exception:  # best effort, as above
            pass


def _limit_setting(bucket: str) -> str:
    """The setting that bounds a run's store: stores are named relax_<run>_<key> (`relax_bus.topology`)."""
    return f"bus.{bucket.rsplit('_', 1)[-1]}_max_bytes"

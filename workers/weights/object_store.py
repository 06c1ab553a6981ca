"""The default weight transport: one safetensors object per version in the run's `weights` object store."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable

from nats.js.api import ObjectInfo

from relax_bus.blob_follow import ChunkFollower
from relax_bus.bus import Bus
from relax_bus.errors import BlobNotFound
from relax_bus.log import get_logger
from relax_bus.outage import through_outage
from schemas import WeightsAnnouncement
from workers.weights.serialization import from_buffer, to_bytes
from workers.weights.transport import StateDict

log = get_logger(__name__)

FOLLOW_STALL_S = 10.0
"""How long a fetch waits for the next chunk of a followed upload before it fetches the object as usual."""


class ObjectStoreTransport:
    """Weights as objects `v<version>` in the run's weights store; keeps v0 and the newest `keep`.

    Streamed: each upload of version v is named `w<v>.<id>` (`BlobStore.put`'s nuid), so a reader told to
    `expect(v)` follows its chunks as they are stored (`relax_bus.blob_follow`) while the trainer is still
    uploading; `read(v)`, called once v is announced, then only waits for the last chunks and checks the
    digest. A reader that followed nothing, or another upload, fetches as usual. It costs the reader a second
    copy of the weights in memory (the version it generates with and the one arriving), and a download of
    every version it was told to expect, used or not (`weights.stream: false` turns it off).
    """

    def __init__(self, bus: Bus, stream: bool = True) -> None:
        self.bus = bus
        self.keep = bus.config.bus.weights_keep
        self.stream = stream
        """Follow the upload of a version `expect` names (`weights.stream`); without it `expect` does nothing."""
        self._follower: tuple[int, ChunkFollower] | None = None
        self.streamed = 0
        """Versions this reader took from a followed upload (the rest were fetched after their announcement)."""

    async def publish(self, version: int, state: StateDict, step: int) -> WeightsAnnouncement:
        data = await asyncio.to_thread(to_bytes, state)  # seconds for a real model: not on the event loop
        name = f"v{version}"

        def put() -> Awaitable[ObjectInfo]:  # a fresh upload id per attempt: a follower tells them apart
            return self.bus.weights.put(name, data, nuid=f"w{version}.{uuid.uuid4().hex[:16]}")

        info = await through_outage(put, f"put weights {name}")
        stale = version - self.keep
        if stale > 0:  # v0 stays: the reference role and restarts from scratch read it
            await through_outage(lambda: self.bus.weights.delete(f"v{stale}"), f"delete weights v{stale}")
        return WeightsAnnouncement(
            run=self.bus.run,
            version=version,
            location=info.name,
            size=len(data),
            step=step,
            digest=None,
        )

    async def expect(self, version: int) -> None:
        if not self.stream or (self._follower is not None and self._follower[0] == version):
            return
        await self._unfollow()
        follower = ChunkFollower(self.bus.js, self.bus.weights.bucket, self.bus.weights.stream, f"w{version}")
        await follower.start()
        self._follower = (version, follower)

    async def read(self, version: int) -> StateDict:
        started = time.perf_counter()
        name = f"v{version}"
        try:
            info = await self.bus.weights.info_or_missing(name)
        except BlobNotFound:
            await self._unfollow()
            raise
        data = None
        if self._follower is not None and self._follower[0] == version:
            data = await self._follower[1].take(info, stall_s=FOLLOW_STALL_S)
            if data is not None:
                self.streamed += 1
                log.info("weights_followed", version=version, waited_s=round(time.perf_counter() - started, 3))
        await self._unfollow()
        if data is None:
            data = await self.bus.weights.get_buffer(name, info=info)
        state = from_buffer(data)
        log.debug(
            "weights_fetched",
            version=version,
            mib=round(len(data) / 2**20, 2),
            seconds=round(time.perf_counter() - started, 3),
            streamed=self.streamed,
        )
        return state

    async def _unfollow(self) -> None:
        if self._follower is not None:
            _, follower = self._follower
            self._follower = None
            await follower.close()

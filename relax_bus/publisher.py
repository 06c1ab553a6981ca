"""Publishing with bounded waits and retries under the same `Nats-Msg-Id`.

Every publish waits for the stream's acknowledgement, but never without a deadline. A publish that
times out, finds no stream responder (a leader election, a server restart) or hits a full stream
(discard=new: back-pressure) is retried with the same id until the deadline, so the server
deduplicates any copy that did land.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api

from relax_bus.blobs import BlobStore
from relax_bus.envelope import MSG_ID, seal
from relax_bus.errors import PublishFailed, StreamFull
from relax_bus.log import get_logger
from schemas import Message

log = get_logger(__name__)

STREAM_FULL = 10077  # JetStream err_code: maximum messages / bytes exceeded with discard=new
RETRYABLE_CODES = {STREAM_FULL, 10008}  # 10008: JetStream temporarily unavailable
ATTEMPT_TIMEOUT_S = 5.0


class Publisher:
    """Publishes messages for one run: claim check, deterministic ids, retries, bounded waits."""

    def __init__(self, js: JetStreamContext, media: BlobStore, claim_threshold: int) -> None:
        self.js = js
        self.media = media
        self.claim_threshold = claim_threshold

    async def publish(
        self, subject: str, message: Message, msg_id: str | None = None, deadline_s: float = 60.0
    ) -> api.PubAck:
        """Publish one message and wait for the stream to store it (or reject it as a duplicate)."""
        payload, headers = await seal(message, self.media, self.claim_threshold, msg_id)
        return await self.publish_raw(subject, payload, headers, deadline_s)

    async def publish_many(self, items: Sequence[tuple[str, Message]], deadline_s: float = 60.0) -> list[api.PubAck]:
        """Publish a batch pipelined (acks awaited together, bounded); failures fall back to `publish_raw`."""
        sealed = [(subject, *await seal(m, self.media, self.claim_threshold)) for subject, m in items]
        futures = [
            await self.js.publish_async(subject, payload, headers=dict(headers)) for subject, payload, headers in sealed
        ]
        done, _ = await asyncio.wait(futures, timeout=ATTEMPT_TIMEOUT_S) if futures else (set(), set())
        acks: list[api.PubAck] = []
        for fut, (subject, payload, headers) in zip(futures, sealed, strict=True):
            if fut in done and fut.exception() is None:
                acks.append(fut.result())
            else:
                if not fut.done():
                    fut.cancel()
                acks.append(await self.publish_raw(subject, payload, headers, deadline_s))
        return acks

    async def publish_raw(
        self, subject: str, payload: bytes, headers: dict[str, str], deadline_s: float = 60.0
    ) -> api.PubAck:
        """Publish bytes, retrying retryable failures with the same headers until `deadline_s`."""
        deadline = time.monotonic() + deadline_s
        delay = 0.05
        last = ""
        full = False
        while True:
            left = deadline - time.monotonic()
            try:
                # js.publish mutates the headers dict it is given: pass a copy each attempt.
                return await self.js.publish(
                    subject, payload, timeout=max(0.05, min(ATTEMPT_TIMEOUT_S, left)), headers=dict(headers)
                )
            except nats.errors.MaxPayloadError:
                limit = self.js._nc.max_payload
                raise PublishFailed(
                    f"publish to {subject} refused: {len(payload)} bytes exceed the server's max_payload ({limit})"
                ) from None
            except nats.js.errors.APIError as err:
                if err.err_code not in RETRYABLE_CODES and err.code != 503:
                    raise PublishFailed(f"publish to {subject} refused: {err.description or err}") from None
                full = err.err_code == STREAM_FULL
                last = err.description or str(err)
            except (
                nats.errors.TimeoutError,
                nats.js.errors.NoStreamResponseError,
                nats.errors.ConnectionClosedError,
                nats.errors.ConnectionReconnectingError,
                nats.errors.OutboundBufferLimitError,
            ) as err:
                full = False
                last = type(err).__name__
            if time.monotonic() + delay >= deadline:
                msg = f"publish to {subject} (id {headers.get(MSG_ID)}) failed for {deadline_s:g}s: {last}"
                raise StreamFull(msg) if full else PublishFailed(msg)
            log.debug("publish_retry", subject=subject, msg_id=headers.get(MSG_ID), reason=last)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

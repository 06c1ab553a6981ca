"""Publishing with bounded waits and retries under the same `Nats-Msg-Id`.

Every publish waits for the stream's acknowledgement, but never without a deadline. A publish that
times out, finds no stream responder (a leader election, a server restart) or hits a full stream
(discard=new: back-pressure) is retried with the same id until the deadline, so the server
deduplicates any copy that did land.

Ids are bound to the content (`relax_bus.publish_ids`), and a publish the server calls a duplicate
is checked: the copy stored at the ack's sequence must be this very message. A copy that is not (a
forgery stored first under the id) does not swallow ours: ours is stored again under a fresh random
id, with a warning naming both sequences.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api

from relax_bus import publish_ids
from relax_bus.backoff import retrying
from relax_bus.blobs import BlobStore
from relax_bus.envelope import MSG_ID, seal
from relax_bus.errors import NatsUnavailable, PublishFailed, StreamFull
from relax_bus.log import get_logger
from relax_bus.outage import through_outage
from schemas import Message

log = get_logger(__name__)

STREAM_FULL = 10077  # JetStream err_code: maximum messages / bytes exceeded with discard=new
RETRYABLE_CODES = {STREAM_FULL, 10008}  # 10008: JetStream temporarily unavailable
ATTEMPT_TIMEOUT_S = 5.0


class _NotStored(Exception):
    """A publish that was not stored but may be when retried: a full stream, a timeout, a leader election."""

    def __init__(self, reason: str, full: bool) -> None:
        super().__init__(reason)
        self.full = full


class Publisher:
    """Publishes messages for one run: claim check, content-bound ids, retries, bounded waits."""

    def __init__(self, js: JetStreamContext, media: BlobStore, claim_threshold: int) -> None:
        self.js = js
        self.media = media
        self.claim_threshold = claim_threshold
        self.ids_taken = 0
        """Publishes whose id was found taken by another message (and were stored under a fresh one)."""

    async def publish(
        self, subject: str, message: Message, msg_id: str | None = None, deadline_s: float = 60.0
    ) -> api.PubAck:
        """Publish one message and wait for the stream to store it (or to hold this very message already)."""
        payload, headers = await self._seal(message, msg_id)
        return await self.publish_raw(subject, payload, headers, deadline_s)

    async def publish_many(self, items: Sequence[tuple[str, Message]], deadline_s: float = 60.0) -> list[api.PubAck]:
        """Publish a batch pipelined (acks awaited together, bounded); failures fall back to `publish_raw`."""
        sealed = [(subject, *await self._seal(m)) for subject, m in items]
        futures = [
            await self.js.publish_async(subject, payload, headers=dict(headers)) for subject, payload, headers in sealed
        ]
        done, _ = await asyncio.wait(futures, timeout=ATTEMPT_TIMEOUT_S) if futures else (set(), set())
        acks: list[api.PubAck] = []
        for fut, (subject, payload, headers) in zip(futures, sealed, strict=True):
            if fut in done and fut.exception() is None:
                ack = fut.result()
                if ack.duplicate:
                    ack = await self._own_duplicate(subject, payload, headers, ack, deadline_s)
                acks.append(ack)
            else:
                if not fut.done():
                    fut.cancel()
                acks.append(await self.publish_raw(subject, payload, headers, deadline_s))
        return acks

    async def publish_raw(
        self, subject: str, payload: bytes, headers: dict[str, str], deadline_s: float = 60.0
    ) -> api.PubAck:
        """Publish bytes, retrying retryable failures with the same headers until `deadline_s`.

        The headers go out as given (`publish` binds the id to the content first); a duplicate answer
        is accepted only for a stored copy that is this message (`_own_duplicate`).
        """
        ack = await self._store(subject, payload, headers, deadline_s)
        if ack.duplicate:
            ack = await self._own_duplicate(subject, payload, headers, ack, deadline_s)
        return ack

    async def _seal(self, message: Message, msg_id: str | None = None) -> tuple[bytes, dict[str, str]]:
        payload, headers = await seal(message, self.media, self.claim_threshold, msg_id)
        return payload, publish_ids.bind(payload, headers)

    async def _own_duplicate(
        self, subject: str, payload: bytes, headers: dict[str, str], ack: api.PubAck, deadline_s: float
    ) -> api.PubAck:
        """The ack to return for a publish the server answered `duplicate` (the id was stored before).

        A genuine retry finds its own copy at the ack's sequence, or none: a copy consumed from a work
        queue (or aged out) was stored under this content-bound id, which only a writer of the hop that
        predicted our exact bytes could have used. Any other copy, a forged one for instance, is left
        where it is (the next role judges it like any message) and ours is stored again under a fresh id.
        """
        stored = await self._stored(subject, headers, ack, deadline_s)
        if stored is None or publish_ids.matches(stored, subject, payload, headers):
            return ack
        again = publish_ids.fresh(headers)
        ours = await self._store(subject, payload, again, deadline_s)
        self.ids_taken += 1
        log.warning(
            "publish_id_taken",
            subject=subject,
            msg_id=headers.get(MSG_ID),
            stream=ack.stream,
            taken_seq=ack.seq,
            taken_subject=stored.subject,
            seq=ours.seq,
            new_msg_id=again[MSG_ID],
        )
        return ours

    async def _stored(
        self, subject: str, headers: dict[str, str], ack: api.PubAck, deadline_s: float
    ) -> api.RawStreamMsg | None:
        """The message stored at the ack's sequence, or None once it is gone from the stream."""
        what = f"read back {ack.stream} #{ack.seq}, stored before under the id {headers.get(MSG_ID)}"
        try:
            return await through_outage(lambda: self.js.get_msg(ack.stream, ack.seq), what, deadline_s)
        except nats.js.errors.NotFoundError:
            return None
        except NatsUnavailable as err:
            raise PublishFailed(f"publish to {subject} was answered duplicate: {err}") from None

    async def _store(self, subject: str, payload: bytes, headers: dict[str, str], deadline_s: float) -> api.PubAck:
        """Publish and wait for the stream's ack, retrying retryable failures with the same headers.

        Waits between attempts: 0.05 s doubling up to 1 s, plus up to 0.05 s of jitter (`relax_bus.backoff`)."""
        deadline = time.monotonic() + deadline_s
        try:
            async for attempt in retrying(_NotStored, deadline_s, wait_initial=0.05, wait_max=1.0):
                with attempt:
                    return await self._store_once(subject, payload, headers, deadline)
        except _NotStored as err:
            msg = f"publish to {subject} (id {headers.get(MSG_ID)}) failed for {deadline_s:g}s: {err}"
            raise StreamFull(msg) if err.full else PublishFailed(msg) from None
        raise AssertionError("unreachable: stamina re-raises the last error")

    async def _store_once(self, subject: str, payload: bytes, headers: dict[str, str], deadline: float) -> api.PubAck:
        """One publish attempt, bounded by what is left until `deadline`; `_NotStored` when worth another."""
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
            retry = _NotStored(err.description or str(err), full=err.err_code == STREAM_FULL)
        except (
            nats.errors.TimeoutError,
            nats.js.errors.NoStreamResponseError,
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.OutboundBufferLimitError,
        ) as err:
            retry = _NotStored(type(err).__name__, full=False)
        log.debug("publish_retry", subject=subject, msg_id=headers.get(MSG_ID), reason=str(retry))
        raise retry

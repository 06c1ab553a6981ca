"""Message envelopes: headers, deterministic publish ids, and the claim check.

A message whose encoded size exceeds the run's claim-check threshold is stored in the run's media
object store under its content digest; the NATS message then carries an empty body and a
`Relax-Claim: sha256:<hex>` header. `open_message` reverses this, so handlers never see the difference.
"""

from __future__ import annotations

from collections.abc import Mapping

from relax_bus.blobs import BlobStore
from schemas import (
    DeadLetter,
    Message,
    PromptGroup,
    RolloutGroup,
    ScoredGroup,
    TrainGroup,
    WeightsAnnouncement,
    decode,
    encode,
)

MSG_ID = "Nats-Msg-Id"
KIND = "Relax-Kind"
SCHEMA = "Relax-Schema"
CLAIM = "Relax-Claim"


def message_id(message: Message) -> str | None:
    """Deterministic publish id (run/group/stage/attempt) so a republish is deduplicated by the server."""
    if isinstance(message, PromptGroup):
        return f"{message.run}/{message.group_id}/prompt/{message.attempt}"
    if isinstance(message, RolloutGroup):
        p = message.prompt
        return f"{p.run}/{p.group_id}/rollout/{p.attempt}"
    if isinstance(message, ScoredGroup):
        p = message.rollout.prompt
        return f"{p.run}/{p.group_id}/scored/{p.attempt}"
    if isinstance(message, TrainGroup):
        p = message.scored.rollout.prompt
        return f"{p.run}/{p.group_id}/train/{p.attempt}"
    if isinstance(message, WeightsAnnouncement):
        return f"{message.run}/weights/{message.version}"
    if isinstance(message, DeadLetter) and message.stream_seq is not None:
        return f"{message.run}/dlq/{message.source_subject}/{message.stream_seq}"
    return None


async def seal(
    message: Message, media: BlobStore, threshold: int, msg_id: str | None = None
) -> tuple[bytes, dict[str, str]]:
    """Encode a message and its headers, moving a payload above `threshold` bytes into the media store."""
    payload = encode(message)
    kind = type(message).model_fields["kind"].default
    headers = {KIND: kind, SCHEMA: message.schema_version}
    mid = msg_id or message_id(message)
    if mid is not None:
        headers[MSG_ID] = mid
    if len(payload) > threshold:
        headers[CLAIM] = await media.put_content(payload)
        payload = b""
    return payload, headers


async def open_payload(data: bytes, headers: Mapping[str, str] | None, media: BlobStore) -> bytes:
    """The message bytes, fetched from the media store when the message is a claim check."""
    claim = (headers or {}).get(CLAIM)
    if claim is None:
        return data
    return await media.get_content(claim)


async def open_message(
    data: bytes, headers: Mapping[str, str] | None, media: BlobStore, expect: type[Message] | None = None
) -> Message:
    """Decode a message (claim check resolved). Raises SchemaError or BlobNotFound on bad input."""
    raw = await open_payload(data, headers, media)
    return decode(raw, expect) if expect is not None else decode(raw)

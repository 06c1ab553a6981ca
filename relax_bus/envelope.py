"""Message envelopes: headers, deterministic publish ids, and the claim check.

A message whose encoded size exceeds the run's claim-check threshold is stored in the run's media
object store; the NATS message then carries an empty body, a `Relax-Claim: sha256:<hex>` header (the
digest the reader verifies) and a `Relax-Claim-Object: claim/<uuid>` header (the object). `open_message`
reverses this, so handlers never see the difference.

Each sealed message gets an object of its own, never shared with another message (content addressing
would let two messages with equal bytes share one): so the consumer that settles a work-queue message
can delete its object (`relax_bus.settle`) without asking who else refers to it. A copy of the headers
(a dead letter) refers to the same object, which is why dead-lettering keeps it; the media store's
max age removes what nobody deletes. A claim without an object header names a content-addressed object
(`BlobStore.put_content`), which is never deleted on settle.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping

from relax_bus.blobs import BlobStore
from schemas import Message, decode, encode

MSG_ID = "Nats-Msg-Id"
KIND = "Relax-Kind"
SCHEMA = "Relax-Schema"
CLAIM = "Relax-Claim"
CLAIM_OBJECT = "Relax-Claim-Object"
CLAIM_PREFIX = "claim/"
"""Names of the per-message claim objects in the media store (the only objects a settle deletes)."""


def message_id(message: Message) -> str | None:
    """Deterministic publish id (run/group/stage/attempt) so a republish is deduplicated by the server: what the
    message's type defines (`Message.publish_id`)."""
    return message.publish_id()


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
        sha = hashlib.sha256(payload).digest()
        name = f"{CLAIM_PREFIX}{uuid.uuid4().hex}"
        await media.put(name, payload, sha256=sha)
        headers[CLAIM] = "sha256:" + sha.hex()
        headers[CLAIM_OBJECT] = name
        payload = b""
    return payload, headers


def claim_object(headers: Mapping[str, str] | None) -> str | None:
    """The per-message media object a claim-checked message refers to; None for an inline message or a
    content-addressed claim."""
    headers = headers or {}
    name = headers.get(CLAIM_OBJECT)
    if CLAIM not in headers or name is None or not name.startswith(CLAIM_PREFIX):
        return None
    return name


async def open_payload(data: bytes, headers: Mapping[str, str] | None, media: BlobStore) -> bytes:
    """The message bytes, fetched from the media store (and checked against the claimed digest) when the
    message is a claim check."""
    claim = (headers or {}).get(CLAIM)
    if claim is None:
        return data
    name = claim_object(headers)
    if name is None:
        return await media.get_content(claim)
    return await media.get(name, sha256_hex=claim.removeprefix("sha256:"))


async def open_message(
    data: bytes, headers: Mapping[str, str] | None, media: BlobStore, expect: type[Message] | None = None
) -> Message:
    """Decode a message (claim check resolved). Raises SchemaError or BlobNotFound on bad input."""
    raw = await open_payload(data, headers, media)
    return decode(raw, expect) if expect is not None else decode(raw)

"""Publish ids that a forged copy cannot take away from an honest publish.

Every publish carries a `Nats-Msg-Id` so that JetStream stores a retried publish once. The id names
the logical message (run/group/stage/attempt: its type's `publish_id`, `relax_bus.envelope.message_id`), which
anyone can predict; a user who may write to a stream, or deliver into it through a consumer (docs/security.md),
could store a copy under that id first, and the server would then answer the honest publish with
`duplicate` and drop it. Two defences, both applied by `relax_bus.publisher`:

- `bind` extends the id with a digest of the content (payload and headers): a retry of the same bytes
  is still deduplicated, a copy with other bytes no longer takes the id, and an id is as hard to guess
  as the message it names. The name of a claim-check object is where the bytes are, not what they are
  (a fresh one per sealing; the claim's digest names the bytes): it is left out, so a message sealed
  again for a retry keeps its id.
- `matches` says whether the copy stored at a duplicate's sequence is ours (same subject, bytes and
  headers). When it is not (a predicted copy planted under another subject, say), the publisher
  stores ours again under `fresh`: the id plus a random suffix, which nobody can take in advance.
"""

from __future__ import annotations

import hashlib
import json
import secrets

from nats.js import api

from relax_bus.envelope import CLAIM_OBJECT, MSG_ID

DIGEST_HEX = 32
"""Hex digits of the content digest in an id (128 bits: no second preimage to be found)."""
NOT_CONTENT = (MSG_ID, CLAIM_OBJECT)
"""Headers that are not part of what a message says: its id, and where a claim-checked payload is stored."""


def _content_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k not in NOT_CONTENT}


def content_digest(payload: bytes, headers: dict[str, str]) -> str:
    """sha256 over the content headers (sorted, as JSON) and the payload, in hex."""
    named = sorted(_content_headers(headers).items())
    h = hashlib.sha256(json.dumps(named).encode())
    h.update(b"\n")
    h.update(payload)
    return h.hexdigest()[:DIGEST_HEX]


def bind(payload: bytes, headers: dict[str, str]) -> dict[str, str]:
    """`headers` with their id, if any, bound to the content: `<id>/<content digest>`."""
    msg_id = headers.get(MSG_ID)
    if msg_id is None:
        return headers
    return {**headers, MSG_ID: f"{msg_id}/{content_digest(payload, headers)}"}


def fresh(headers: dict[str, str]) -> dict[str, str]:
    """`headers` under a new id nobody can predict: the id plus 64 random bits."""
    return {**headers, MSG_ID: f"{headers.get(MSG_ID, '')}/{secrets.token_hex(8)}"}


def matches(stored: api.RawStreamMsg, subject: str, payload: bytes, headers: dict[str, str]) -> bool:
    """Whether the stored message is the one we publish: its subject, bytes, id and content headers (a
    claim-checked copy sealed by an earlier attempt names an object of its own; its reader checks that
    object against the claim's digest, which must be ours)."""
    theirs = dict(stored.headers or {})
    return (
        stored.subject == subject
        and (stored.data or b"") == payload
        and theirs.get(MSG_ID) == headers.get(MSG_ID)
        and _content_headers(theirs) == _content_headers(headers)
    )

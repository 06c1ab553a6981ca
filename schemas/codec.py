"""The wire format: a message is a msgpack map of its fields (bytes stay bytes).

`decode` checks, in order, that the payload is a msgpack map, that it names a known `kind`, that its
major schema version is one this code reads, and that the fields validate. Each failure raises its
own `SchemaError` subclass with a message that names what is wrong, so the bus can dead-letter the
payload with a readable reason.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

import msgpack
from pydantic import ValidationError

from schemas.errors import InvalidMessage, MalformedPayload, SchemaError, UnknownKind, UnknownSchemaVersion
from schemas.messages import MESSAGE_TYPES, SCHEMA_MAJOR, Message

M = TypeVar("M", bound=Message)


def encode(message: Message) -> bytes:
    """Serialize a message to msgpack bytes; InvalidMessage when a field cannot travel (e.g. a lone surrogate)."""
    try:
        return msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)  # type: ignore[no-any-return]
    except UnicodeEncodeError as err:
        kind = getattr(message, "kind", type(message).__name__)
        bad = err.object[err.start : err.end]
        raise InvalidMessage(
            f"{kind} message cannot be encoded: a string holds {bad!r} at position {err.start}, "
            f"which is not valid Unicode text ({err.reason})"
        ) from None


def peek_kind(data: bytes) -> tuple[str, str]:
    """Return `(kind, schema_version)` of a payload without validating its fields."""
    fields = _unpack(data)
    return _kind_and_version(fields)


@overload
def decode(data: bytes) -> Message: ...
@overload
def decode(data: bytes, expect: type[M]) -> M: ...
def decode(data: bytes, expect: type[Message] | None = None) -> Message:
    """Deserialize msgpack bytes into the message model their `kind` names.

    With `expect`, a payload of any other kind is refused with `UnknownKind`.
    """
    fields = _unpack(data)
    kind, version = _kind_and_version(fields)
    model = MESSAGE_TYPES.get(kind)
    if model is None:
        raise UnknownKind(f"unknown message kind {kind!r} (known: {', '.join(sorted(MESSAGE_TYPES))})")
    if expect is not None and model is not expect:
        want = expect.model_fields["kind"].default
        raise UnknownKind(f"expected a {want!r} message, got {kind!r}")
    major = int(version.split(".", 1)[0])
    if major != SCHEMA_MAJOR:
        raise UnknownSchemaVersion(
            f"{kind} schema version {version} is not supported (this code reads major {SCHEMA_MAJOR})"
        )
    try:
        return model.model_validate(fields)
    except SchemaError:
        raise
    except ValidationError as err:
        raise InvalidMessage(f"invalid {kind} message: {_summarize(err)}") from None


def _unpack(data: bytes) -> dict[str, Any]:
    try:
        fields = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except UnicodeDecodeError as err:
        raise MalformedPayload(f"payload of {len(data)} bytes has a string that is not valid UTF-8: {err}") from None
    except Exception as err:  # msgpack raises several unrelated types for corrupt input
        raise MalformedPayload(f"payload of {len(data)} bytes is not valid msgpack: {err}") from None
    if not isinstance(fields, dict):
        raise MalformedPayload(f"payload is a msgpack {type(fields).__name__}, not a map")
    return fields


def _kind_and_version(fields: dict[str, Any]) -> tuple[str, str]:
    kind = fields.get("kind")
    if not isinstance(kind, str):
        raise MalformedPayload("payload has no 'kind' field")
    version = fields.get("schema_version")
    if not isinstance(version, str) or not version.replace(".", "", 1).isdigit() or "." not in version:
        raise UnknownSchemaVersion(f"{kind} payload has no valid schema_version (got {version!r})")
    return kind, version


def _summarize(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:5]:
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        parts.append(f"{loc}: {e['msg']}")
    more = err.error_count() - len(parts)
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")

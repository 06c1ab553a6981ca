"""`relax decode`: a message body of the bus (msgpack) as JSON, for people reading streams with the NATS CLI.

Message bodies stay msgpack on the wire (compact, fast, bytes stay bytes); this turns one into JSON:

    nats stream get RELAX_demo_DLQ 7 --translate 'relax decode'      # the CLI pipes the body in
    nats stream view RELAX_demo_TRAIN --translate 'relax decode'      # one `relax decode` per message
    nats stream get RELAX_demo_DLQ 7 --json | relax decode            # the CLI's JSON: headers too

Input is recognised by its first byte: a msgpack map starts with 0x80-0x8f, 0xde or 0xdf, the CLI's
JSON with `{`. `--lines` reads one message per line instead, each a base64 body or such a JSON object,
and writes one JSON line each (`nats stream view --raw` is no such input: it prints raw bytes with a
newline after each message, and a msgpack body may itself hold newline bytes). Bytes fields (tensor
data) come out as base64 strings. The output is strict JSON (RFC 8259, what `jq` and `JSON.parse` read): a
float that is NaN or infinite (the `warmup_accuracy` of a run without warm-up, say) comes out as `null`. A
claim-checked message has an empty body and names an object of the run's media store in its headers; its
JSON form says which, and the object's bytes, fetched with `nats object get`, decode like any body.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

import msgpack

from relax_bus.envelope import CLAIM, CLAIM_OBJECT
from schemas import SchemaError, decode


class Undecodable(ValueError):
    """Raised when the input is neither a msgpack body nor the NATS CLI's JSON of a stored message."""


def body_to_json(data: bytes) -> tuple[dict[str, Any], str | None]:
    """A msgpack body as a JSON-ready mapping, and a warning when it is a map but not a valid message.

    A payload of an unknown kind, a newer major schema or with invalid fields is still shown (its raw
    fields), with the reason the bus would refuse it as the warning."""
    try:
        return _jsonable(decode(data).model_dump(mode="python")), None
    except SchemaError as err:
        reason = str(err)
    try:
        fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as err:  # msgpack raises several unrelated types for corrupt input
        raise Undecodable(f"{len(data)} bytes that are not a msgpack message: {err}") from None
    if not isinstance(fields, dict):
        raise Undecodable(f"{len(data)} bytes holding a msgpack {type(fields).__name__}, not a message (a map)")
    return _jsonable(fields), reason


def stored_to_json(stored: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The NATS CLI's JSON of a stored message (`nats stream get --json`: base64 `data` and `hdrs`)
    with its body decoded; a claim-checked body is named, not fetched."""
    try:
        data = base64.b64decode(stored.get("data") or "", validate=True)
        headers = _headers(base64.b64decode(stored.get("hdrs") or "", validate=True))
    except (binascii.Error, ValueError) as err:
        raise Undecodable(f"a JSON object whose data/hdrs are not base64: {err}") from None
    out: dict[str, Any] = {k: stored[k] for k in ("subject", "seq", "time") if k in stored}
    out["headers"] = headers
    warning = None
    if not data and CLAIM in headers:
        out["claim_check"] = {"digest": headers[CLAIM], "object": headers.get(CLAIM_OBJECT)}
        warning = (
            f"claim-checked message: its body is object {headers.get(CLAIM_OBJECT)!r} of the run's media "
            "store (relax_<run>_media); `nats object get` it and pipe the file to `relax decode`"
        )
    else:
        out["message"], warning = body_to_json(data)
    return out, warning


def to_json(data: bytes) -> tuple[dict[str, Any], str | None]:
    """One input (a msgpack body, or the CLI's JSON of a stored message) as a mapping and a warning."""
    if not data.strip():
        raise Undecodable("no input: an empty body (a claim-checked message has one: use `nats stream get --json`)")
    if data.lstrip()[:1] == b"{":
        try:
            stored = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise Undecodable(f"input starts like JSON but is not: {err}") from None
        if not isinstance(stored, dict) or "data" not in stored:
            raise Undecodable("a JSON object without `data`: not the NATS CLI's JSON of a stored message")
        return stored_to_json(stored)
    return body_to_json(data)


def line_to_json(line: bytes) -> tuple[dict[str, Any], str | None]:
    """One line of `--lines` input: the CLI's JSON of a stored message, or a base64 body."""
    line = line.strip()
    if line[:1] == b"{":
        return to_json(line)
    try:
        body = base64.b64decode(line, validate=True)
    except binascii.Error as err:
        raise Undecodable(f"a line that is neither JSON nor base64: {err}") from None
    return body_to_json(body)


def _headers(block: bytes) -> dict[str, str]:
    """`NATS/1.0\\r\\nKey: value\\r\\n...` as a mapping (the last value of a repeated key)."""
    out: dict[str, str] = {}
    for line in block.decode(errors="replace").split("\r\n")[1:]:
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _jsonable(value: Any) -> Any:
    """`value` with bytes as base64 and NaN and +-infinity as None: JSON has neither."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value

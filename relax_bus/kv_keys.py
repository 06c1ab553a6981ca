"""Listing the keys of a KV bucket in one request, without nats-py's `KeyValue.keys()`.

`KeyValue.keys()` starts an ordered consumer and decides "no more keys" from a consumer-info
reply that can overtake the first delivered entry; on a loaded machine it then returns no keys for
a bucket that has some (seen about once in 300 calls beside one busy process per core). Asking the
stream for its subjects is one request with no such race. A key whose newest message is a delete
or TTL marker is still listed; `kv.get` on it raises `KeyNotFoundError`, which callers skip.
"""

from __future__ import annotations

from nats.js.kv import KeyValue


async def kv_keys(kv: KeyValue) -> list[str]:
    """Every key with a message in the bucket, sorted ([] for an empty bucket)."""
    # nats-py exposes the bucket's stream, context and subject prefix only as these attributes.
    info = await kv._js.stream_info(kv._stream, subjects_filter=f"{kv._pre}>")
    prefix = len(kv._pre)
    return sorted(subject[prefix:] for subject in (info.state.subjects or {}))

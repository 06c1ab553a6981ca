"""Reading stored messages by direct get, the way roles read without a consumer of their own.

A user allowed to create a consumer can point its delivery at any subject, even one it may not publish to,
API subjects included (nats-server does not check a push consumer's delivery subject against the creator's
permissions): it could reset another role's durable or forge a server advisory. So no role user creates
consumers. Roles read the messages they only look at (object chunks, KV entries, events and dead letters)
by direct get, a request answered by whichever server holds the stream, with no server-side state:

    $JS.API.DIRECT.GET.<stream>  {"seq": N, "next_by_subj": S, "batch": K}

answers with up to K stored messages under S (wildcards allowed) from sequence N on, each as its own message
carrying its subject and sequence in headers, then an end-of-batch status (204); a 404 status when there is
none. A reply goes to the requester's own inbox; an API subject named as a reply gets an answer, not a call.
The stream must allow direct get (`allow_direct`: every stream `relax_bus.provision` makes does).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import NamedTuple

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from relax_bus.errors import RelaxBusError

API = "$JS.API.DIRECT.GET"
SUBJECT, SEQUENCE, PENDING = "Nats-Subject", "Nats-Sequence", "Nats-Num-Pending"
STATUS = "Status"
END_OF_BATCH, NOT_FOUND, NO_RESPONDERS = "204", "404", "503"


class Stored(NamedTuple):
    """One stored message, as direct get returns it."""

    subject: str
    seq: int
    data: bytes
    headers: dict[str, str] | None
    """The headers it was published with, and the server's (`Nats-Subject`, `Nats-Sequence`, ...)."""


class DirectGetFailed(RelaxBusError):
    """The server answered a direct get with an error status."""


async def read_batch(
    nc: NATS,
    stream: str,
    subject: str,
    *,
    from_seq: int = 1,
    batch: int = 64,
    max_bytes: int | None = None,
    timeout_s: float = 10.0,
) -> AsyncIterator[Stored]:
    """Up to `batch` messages of `stream` stored under `subject` from sequence `from_seq` on, in stream order,
    each yielded as it arrives (none when there is none yet).

    Raises `nats.errors.TimeoutError` when the answer stops for `timeout_s`, `nats.errors.NoRespondersError` when
    no server answers for the stream, `DirectGetFailed` on another error.
    """
    request: dict[str, object] = {"seq": max(from_seq, 1), "next_by_subj": subject, "batch": batch}
    if max_bytes is not None:
        request["max_bytes"] = max_bytes
    async for stored in _answers(nc, stream, request, timeout_s):
        yield stored


async def read_all(
    nc: NATS,
    stream: str,
    subject: str,
    *,
    from_seq: int = 1,
    batch: int = 64,
    timeout_s: float = 10.0,
) -> AsyncIterator[Stored]:
    """Every message of `stream` stored under `subject` from `from_seq` to the last one stored now."""
    seq = from_seq
    while True:
        got = 0
        async for stored in read_batch(nc, stream, subject, from_seq=seq, batch=batch, timeout_s=timeout_s):
            got += 1
            seq = stored.seq + 1
            yield stored
        if got < batch:
            return


async def last_per_subject(
    nc: NATS, stream: str, subject: str, *, most: int = 1024, timeout_s: float = 10.0
) -> list[Stored]:
    """The newest message of each subject matching `subject` in `stream` (e.g. every object's info record), at
    most `most` of them (`DirectGetFailed` beyond: too many to list in one answer)."""
    request = {"multi_last": [subject], "batch": most + 1}
    out = [s async for s in _answers(nc, stream, request, timeout_s)]
    if len(out) > most:
        raise DirectGetFailed(f"more than {most} subjects under {subject} in {stream}")
    return out


async def _answers(nc: NATS, stream: str, request: dict[str, object], timeout_s: float) -> AsyncIterator[Stored]:
    """The messages answering one direct-get request, up to its end-of-batch or not-found status."""
    replies: asyncio.Queue[Msg] = asyncio.Queue()
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=replies.put)
    try:
        await nc.publish(f"{API}.{stream}", json.dumps(request).encode(), reply=inbox)
        while True:
            try:
                msg = await asyncio.wait_for(replies.get(), timeout_s)
            except TimeoutError:
                raise nats.errors.TimeoutError from None
            headers = msg.headers or {}
            status = headers.get(STATUS)
            if status in (END_OF_BATCH, NOT_FOUND):
                return
            if status == NO_RESPONDERS:
                raise nats.errors.NoRespondersError  # the stream's server is away (or the stream is gone)
            if status is not None:
                why = next((v for k, v in headers.items() if str(k).lower().endswith("description")), "")
                raise DirectGetFailed(f"direct get on {stream} answered {status} {why}".rstrip())
            if not msg.data and not msg.headers:
                # A single-message reply without the batch form (an old server): nothing to read here.
                return
            yield Stored(headers.get(SUBJECT, ""), int(headers.get(SEQUENCE, 0)), msg.data, msg.headers)
    finally:
        try:
            await sub.unsubscribe()
        except nats.errors.Error:
            pass  # tolerated: the subscription died with the connection

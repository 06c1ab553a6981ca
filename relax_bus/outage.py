"""Riding through a NATS outage: retry an idempotent bus operation while the server is away.

A server restart (or a cluster electing a new leader) shows up to a client as timeouts, "no
responders", a reconnecting or closed connection, or JetStream answering 503 for a few seconds.
`through_outage` retries one idempotent operation through that window and gives up with
`NatsUnavailable` only when the outage outlasts its deadline. Operations that are not idempotent
(a compare-and-set whose answer was lost) must resolve the ambiguity themselves; see
`relax_bus.kv_counter.KvCounter.cas`. A role reads and writes the run's state through `Bus.run_state`,
whose methods ride through an outage themselves (`relax_bus.run_state`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors

from relax_bus.backoff import retrying
from relax_bus.errors import AcksLost, NatsUnavailable, PermissionDenied
from relax_bus.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")

OUTAGE_S = 120.0
"""How long a role waits for NATS to come back before it gives up (and its supervisor restarts it)."""

TRANSIENT: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
    TimeoutError,
    AcksLost,
)

TRANSIENT_FETCH: tuple[type[BaseException], ...] = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
)
"""What a pull `fetch` raises while the server restarts or a stream elects a leader (not its timeout)."""


_denials: list[tuple[float, str]] = []


def note_denied(text: str) -> None:
    """Record a permission violation the server reported (nats-py only tells the error callback)."""
    _denials.append((time.monotonic(), text))
    del _denials[:-16]


def raise_if_denied(started: float, what: str) -> None:
    """Raise PermissionDenied if the server reported a permission violation since `started`."""
    denied = next((text for at, text in reversed(_denials) if at >= started), None)
    if denied is not None:  # a refused permission also looks like a timeout: no point waiting
        raise PermissionDenied(f"{what}: {denied}")


def is_transient(err: BaseException) -> bool:
    """True for the errors a server restart or a leader election produces."""
    if isinstance(err, nats.js.errors.APIError) and getattr(err, "code", None) == 503:
        return True
    return isinstance(err, TRANSIENT)


async def through_outage(op: Callable[[], Awaitable[T]], what: str, deadline_s: float = OUTAGE_S) -> T:
    """Run `op` (idempotent), retrying transient failures with backoff for up to `deadline_s` seconds.

    Waits between attempts: 0.1 s doubling up to 2 s, plus up to 0.5 s of jitter (`relax_bus.backoff`). A
    request that times out (a loaded server, a start-up read) is retried as a lost connection is. One log line
    per outage, when the first attempt fails; `NatsUnavailable` (one line) once it outlasts `deadline_s`."""
    started = time.monotonic()
    try:
        async for attempt in retrying(is_transient, deadline_s, wait_initial=0.1, wait_max=2.0, jitter=0.5):
            with attempt:
                try:
                    return await op()
                except Exception as err:
                    if is_transient(err):
                        raise_if_denied(started, what)  # PermissionDenied is not retried
                        if attempt.num == 1:
                            log.info("nats_outage_retry", op=what, error=type(err).__name__, retrying_for_s=deadline_s)
                    raise
    except Exception as err:
        if not is_transient(err):
            raise
        raise NatsUnavailable(f"{what}: NATS unavailable for {deadline_s:g}s ({type(err).__name__})") from None
    raise AssertionError("unreachable: stamina re-raises the last error")

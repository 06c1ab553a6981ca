"""Retry loops of the bus: stamina's capped exponential backoff with jitter, bounded by a deadline.

Every loop that waits for NATS to come back (`relax_bus.outage`, the first connection, publishing, the
provisioning of a fresh server) iterates `retrying(...)`. The wait before retry n is

    wait_n = min(wait_max, wait_initial * 2**(n - 1) + U(0, jitter))

so the clients that lost the same server spread their attempts instead of arriving together. Retries stop
once `deadline_s` has passed since the first attempt (the last wait may end up to `wait_max` past it) or
after `attempts`; stamina then re-raises the last error, which the caller turns into its own one-line error.
A deadline of 0 or less means one attempt and no retry.

Each caller logs its own structlog event per attempt (with the operation's name); `relax_bus.log.configure`
routes stamina's per-retry hook to one debug event, `retry_scheduled`, instead of its default warning with
the arguments' reprs. `stamina.set_testing(True)` turns the waits off and caps the attempts: the bus and chaos
tests leave it off, since they rely on the deadlines.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable

import stamina

OnError = type[Exception] | tuple[type[Exception], ...] | Callable[[Exception], bool]
"""What stamina retries: exception types, or a predicate on the error (True: retry it)."""


def retrying(
    on: OnError,
    deadline_s: float | None,
    *,
    wait_initial: float,
    wait_max: float,
    jitter: float | None = None,
    attempts: int | None = None,
) -> AsyncIterable[stamina.Attempt]:
    """stamina's retry context: retry errors `on` accepts until `deadline_s` (None: no deadline) and at most
    `attempts` attempts (None: no limit), waiting min(wait_max, wait_initial * 2**(n-1) + U(0, jitter)) before
    retry n; `jitter` defaults to `wait_initial`."""
    timeout = deadline_s
    if deadline_s is not None and deadline_s <= 0:
        attempts, timeout = 1, None
    return stamina.retry_context(
        on=on,
        attempts=attempts,
        timeout=timeout,
        wait_initial=wait_initial,
        wait_max=wait_max,
        wait_jitter=wait_initial if jitter is None else jitter,
    )

"""The bus's retry loops (relax_bus.backoff over stamina): deadlines, what is retried, jittered waits."""

from __future__ import annotations

import time

import nats.errors
import pytest
import stamina

from relax_bus.backoff import retrying
from relax_bus.errors import NatsUnavailable, PermissionDenied
from relax_bus.outage import note_denied, through_outage

pytestmark = pytest.mark.unit


class Flaky:
    """An operation that fails with `error` `failures` times, then returns "ok"; it counts its calls."""

    def __init__(self, error: Exception, failures: int) -> None:
        self.error, self.failures, self.calls = error, failures, 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


async def test_transient_errors_are_retried_until_the_operation_works() -> None:
    op = Flaky(nats.errors.NoRespondersError(), failures=3)
    assert await through_outage(op, "read x", deadline_s=30) == "ok"
    assert op.calls == 4


async def test_an_outage_longer_than_the_deadline_is_one_error() -> None:
    op = Flaky(nats.errors.TimeoutError(), failures=10**6)
    started = time.monotonic()
    with pytest.raises(NatsUnavailable, match=r"read x: NATS unavailable for 0\.3s \(TimeoutError\)"):
        await through_outage(op, "read x", deadline_s=0.3)
    # The waits double from 0.1 s and are capped at 2 s: the last one may end past the deadline, by < 2.5 s.
    assert 0.3 <= time.monotonic() - started < 2.8
    assert op.calls >= 2


async def test_a_zero_deadline_tries_once() -> None:
    op = Flaky(nats.errors.TimeoutError(), failures=1)
    with pytest.raises(NatsUnavailable):
        await through_outage(op, "read x", deadline_s=0)
    assert op.calls == 1


async def test_other_errors_are_not_retried() -> None:
    op = Flaky(KeyError("x"), failures=1)
    with pytest.raises(KeyError):
        await through_outage(op, "read x", deadline_s=30)
    assert op.calls == 1


async def test_a_refused_permission_is_not_waited_out() -> None:
    class Denied(Flaky):
        async def __call__(self) -> str:
            note_denied("Permissions Violation for Subscription to x")  # what the error callback records
            return await super().__call__()

    op = Denied(nats.errors.TimeoutError(), failures=10**6)
    with pytest.raises(PermissionDenied, match="read x: Permissions Violation"):
        await through_outage(op, "read x", deadline_s=30)
    assert op.calls == 1


async def test_attempts_bound_the_retries_and_waits_are_jittered() -> None:
    waits: list[float] = []
    hooks = stamina.instrumentation.get_on_retry_hooks()
    stamina.instrumentation.set_on_retry_hooks([lambda d: waits.append(d.wait_for)])
    try:
        op = Flaky(ValueError("no"), failures=10**6)
        with pytest.raises(ValueError):
            async for attempt in retrying(ValueError, None, wait_initial=0.01, wait_max=0.02, attempts=4):
                with attempt:
                    await op()
    finally:
        stamina.instrumentation.set_on_retry_hooks(hooks)
    assert op.calls == 4 and len(waits) == 3
    # wait_n = min(wait_max, wait_initial * 2**(n-1) + U(0, jitter)), jitter = wait_initial by default
    assert 0.01 <= waits[0] <= 0.02 + 1e-9 and all(w <= 0.02 + 1e-9 for w in waits)


async def test_testing_mode_skips_the_waits() -> None:
    op = Flaky(nats.errors.TimeoutError(), failures=2)
    with stamina.set_testing(True, attempts=3):
        started = time.monotonic()
        assert await through_outage(op, "read x", deadline_s=600) == "ok"
        assert time.monotonic() - started < 0.1
    assert not stamina.is_testing()

"""Tests wait for state, never for time: poll what is checked, and on expiry say what was last seen.

`until` waits for a condition to become true; `holds` checks that one stays true for a while (the
only honest way to test that something does *not* happen), failing at the first poll that breaks it.
A loaded machine makes either slower, never wrong.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
Probe = Callable[[], "T | Awaitable[T]"]


async def _read(probe: Probe[T]) -> T:
    value = probe()
    if inspect.isawaitable(value):
        return await value
    return value  # type: ignore[return-value]


async def until(
    probe: Probe[T], ok: Callable[[T], bool], timeout_s: float = 60.0, what: str = "condition", poll_s: float = 0.05
) -> T:
    """Poll `probe()` every `poll_s` until `ok(value)`; return that value, or fail with the last value seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await _read(probe)
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s:g}s; last seen: {value!r}"
        await asyncio.sleep(poll_s)


async def holds(probe: Probe[T], ok: Callable[[T], bool], for_s: float, what: str = "condition") -> T:
    """Poll `probe()` for `for_s` seconds; fail at the first value for which `ok` is false."""
    deadline = time.monotonic() + for_s
    while True:
        value = await _read(probe)
        assert ok(value), f"{what} broke: {value!r}"
        if time.monotonic() >= deadline:
            return value
        await asyncio.sleep(0.05)

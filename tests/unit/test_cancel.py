"""`cancel_and_wait` ends a task even when a cancellation is swallowed on its way in."""

from __future__ import annotations

import asyncio

import pytest

from relax_bus.cancel import cancel_and_wait

pytestmark = pytest.mark.unit


async def test_a_task_that_swallows_the_first_cancel_is_still_stopped():
    attempts = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                attempts.append(len(attempts))
                if len(attempts) < 3:
                    continue  # what a wait_for that raced its inner result does on Python 3.11
                raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, retry_s=0.01), 5.0)
    assert task.cancelled()
    assert attempts == [0, 1, 2]


async def test_wait_for_racing_its_result_is_stopped():
    """The case from nats-py: a watcher's `wait_for(queue.get())` cancelled as an update lands."""
    updates: asyncio.Queue[int] = asyncio.Queue()
    seen = []

    async def watcher() -> None:
        while True:
            seen.append(await asyncio.wait_for(updates.get(), 10))

    task = asyncio.create_task(watcher())
    await asyncio.sleep(0)
    updates.put_nowait(1)
    await asyncio.wait_for(cancel_and_wait(task, retry_s=0.01), 5.0)
    assert task.done()


async def test_an_ended_task_and_none_are_fine():
    async def fails() -> None:
        raise RuntimeError("ended with an error")

    task = asyncio.create_task(fails())
    await asyncio.wait({task})
    await cancel_and_wait(task)  # its error is the stopper's no concern
    await cancel_and_wait(None)

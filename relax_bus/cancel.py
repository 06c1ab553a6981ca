"""Stopping a background task for sure.

On Python 3.11 `asyncio.wait_for` swallows a cancellation that arrives in the same loop iteration as
its inner result (gh-86296, fixed in 3.12): the task carries on as if never cancelled, and
`task.cancel(); await task` then waits forever. nats-py waits through `wait_for` everywhere (KV
watcher updates, requests, publish acks), so a watcher or heartbeat task cancelled at the moment an
update or a reply lands would hang the caller's shutdown. `cancel_and_wait` cancels again until the
task has really ended.
"""

from __future__ import annotations

import asyncio
import contextlib

RETRY_S = 0.2


async def cancel_and_wait(task: asyncio.Task[object] | None, retry_s: float = RETRY_S) -> None:
    """Cancel `task` and wait until it has ended, cancelling again every `retry_s` while it runs on.

    What the task raised while ending (its cancellation included) is not the caller's concern here:
    the caller is stopping it.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry_s)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()  # retrieved, so an ended task's error is not reported as never retrieved

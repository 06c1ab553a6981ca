"""Credit for dead-lettered groups: a released group that a stage dead-lettered will never train.

The feeder follows the run's dlq stream from its start (the bus's `Follower` on an ordered consumer, so a
restarted feeder counts the same letters again) and collects the release index of every dead letter whose payload is
one of this run's groups. Each such group is replaced like a stale drop; a letter that is not a group
(garbage, a foreign message) earns nothing, and neither does one naming a group the feeder never released
(a release index it has not reached, or a group id other than the one it gave that index): whoever can
publish to the dlq cannot raise the release budget past one replacement per group released.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from relax_bus.bus import Bus
from relax_bus.cancel import cancel_and_wait
from relax_bus.envelope import open_message
from relax_bus.follow import Followed, Follower
from relax_bus.log import get_logger
from schemas import GROUP_MESSAGES, DeadLetter

log = get_logger(__name__)

STOP_WAIT_S = 2.0
"""How long a stop waits for the follower to finish the letters in hand before it cancels it."""


class DeadLetterCredit:
    """The release indices of this run's groups found in its dead letters."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.seen: set[tuple[int, str]] = set()
        """(release index, group id) of every dead-lettered group of this run, as the letters name them."""
        self.follower = Follower.ordered(bus, "dlq", self._take)
        self._task: asyncio.Task[object] | None = None

    def credit(self, released: int, group_id_of: Callable[[int], str]) -> int:
        """Dead-lettered groups this feeder released: an index below `released` with the id it gave that index."""
        return len({i for i, g in self.seen if i < released and g == group_id_of(i)})

    async def start(self) -> DeadLetterCredit:
        """Subscribe (a refused permission fails here), then follow the letters in the background."""
        await self.follower.open()
        self._task = asyncio.create_task(self.follower.run(), name="dead-letter-credit")
        self._task.add_done_callback(_report_failure)
        return self

    async def stop(self) -> None:
        self.follower.stop()  # wakes its wait at once
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=STOP_WAIT_S)
            await cancel_and_wait(self._task)  # one still reading a letter through an outage: no acks to lose

    async def _take(self, batch: list[Followed]) -> None:
        for _, letter in batch:  # a letter that does not decode, or is no DeadLetter, earns nothing
            if isinstance(letter, DeadLetter):
                await self._count(letter)

    async def _count(self, letter: DeadLetter) -> None:
        try:
            message = await open_message(letter.payload, letter.headers, self.bus.media)
        except Exception:  # deliberate: a letter that is not one of our groups earns no credit
            return
        if not isinstance(message, GROUP_MESSAGES) or message.prompt.run != self.bus.run:
            return
        prompt = message.prompt
        key = (prompt.release_index, prompt.group_id)
        if key not in self.seen:
            self.seen.add(key)
            log.info("dead_letter_seen", group_id=prompt.group_id, release_index=prompt.release_index)


def _report_failure(task: asyncio.Task[object]) -> None:
    if not task.cancelled() and (err := task.exception()) is not None:
        log.error("dead_letters_unfollowed", error=f"{type(err).__name__}: {err}")

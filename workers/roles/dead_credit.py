"""Credit for dead-lettered groups: a released group that a stage dead-lettered will never train.

The feeder follows the run's dlq stream from its start (the bus's `Follower`, by direct get, so a
restarted feeder counts the same letters again) and collects the release index of every dead letter whose payload is
one of this run's groups. A letter that is not a group (garbage, a foreign message) earns nothing, and neither
does one naming a group the feeder never released (a release index it has not reached, or a group id other than
the one it gave that index), one the reward role already filtered (replaced by that credit), or one counted
before.

Any role may publish to the dlq, and a forged letter for a group still in flight looks like a real one. Before
the bound below, every replacement was a new release index that the next forged letter could name: 66 releases
became 322 at policy version 0 in four rounds. So the credit is also bounded by what has left the pipeline
without being accounted for (`dead_credit`):

    credit = min(letters, released - trained - dropped - filtered - on_bus)

`trained` is the trainer's steps times groups_per_step, `dropped` its stale drops, `filtered` the reward role's
(all in the run's state KV), and `on_bus` the groups the bus still holds: the messages under each hop's own
subject (pending or being worked on: a work queue keeps a message until it is acked) and those the actor has
not acked on the train stream. A real dead letter's group is off the bus (the stage terminated its message) and
never trains, so it is credited; a forged letter's group is on the bus, or trains later, so it is not, or no
longer (the credit is recomputed on every poll, and a replacement already released only makes the feeder wait).
A group is counted as settled before it leaves the bus (the actor records its step before the acks, its drops
before settling them), and the bus is read before what is settled: a group between two counts is counted twice
for a moment (the bound is one batch too low, and a real letter's credit waits for the next poll), never missed.
Filtered groups are read once, before the bus: with `sampling.drop_uniform`, a group filtered between the two
reads can still make the bound one group too high for a moment.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import nats.js.errors

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

    def letters(self, released: int, group_id_of: Callable[[int], str], filtered: Callable[[int], bool]) -> int:
        """Dead-lettered groups this feeder released (an index below `released` with the id it gave that index)
        and the reward role did not filter."""
        return len({i for i, g in self.seen if i < released and g == group_id_of(i) and not filtered(i)})

    async def credit(
        self,
        released: int,
        group_id_of: Callable[[int], str],
        filtered: Callable[[int], bool],
        settled: Callable[[], Awaitable[int]],
    ) -> int:
        """Groups to replace for their dead letters: `dead_credit` of the letters, with `settled()` the groups
        trained, dropped as stale or filtered so far. Asks the server only while some letter counts.

        The bus is counted first, then what is settled: a group is counted as settled (the actor's step count,
        its drop count) before it leaves the bus, so in this order it is counted once or twice, never missed."""
        letters = self.letters(released, group_id_of, filtered)
        if letters == 0:
            return 0
        held = await self.on_bus()
        return dead_credit(letters, released, await settled(), held)

    async def on_bus(self) -> int:
        """Groups the bus still holds: messages under each hop's own subject, and the train stream's messages
        its consumer has not acked."""
        js, t = self.bus.js, self.bus.topology
        held = 0
        for key in self.bus.config.hop_keys():
            spec = t.stream(key)
            info = await js.stream_info(spec.name, subjects_filter=spec.subject)
            held += (info.state.subjects or {}).get(spec.subject, 0)
        train = t.stream("train").name
        for c in t.consumers:
            if c.stream_key != "train":
                continue
            try:
                info = await js.consumer_info(train, c.durable)
            except nats.js.errors.NotFoundError:
                continue
            held += info.num_pending + info.num_ack_pending
        return held

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


def dead_credit(letters: int, released: int, settled: int, on_bus: int) -> int:
    """min(letters, released - settled - on_bus), at least 0: dead-lettered groups credited at most as many as
    the released groups that are neither settled (trained, dropped as stale, filtered) nor on the bus."""
    return max(0, min(letters, released - settled - on_bus))


def _report_failure(task: asyncio.Task[object]) -> None:
    if not task.cancelled() and (err := task.exception()) is not None:
        log.error("dead_letters_unfollowed", error=f"{type(err).__name__}: {err}")

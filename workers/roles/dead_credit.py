"""Credit for dead-lettered groups: a released group that a stage dead-lettered will never train.

The feeder follows the run's dlq stream from its start (an ordered consumer, so a restarted feeder
counts the same letters again) and collects the release index of every dead letter whose payload is
one of this run's groups. Each such group is replaced like a stale drop; a letter that is not a group
(garbage, a foreign message) earns nothing, and neither does one naming a group the feeder never released
(a release index it has not reached, or a group id other than the one it gave that index): whoever can
publish to the dlq cannot raise the release budget past one replacement per group released.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg

from relax_bus.bus import Bus
from relax_bus.envelope import open_message
from relax_bus.log import get_logger
from schemas import DeadLetter, PromptGroup, RolloutGroup, ScoredGroup, TrainGroup

log = get_logger(__name__)


def _prompt(message: Any) -> PromptGroup | None:
    if isinstance(message, PromptGroup):
        return message
    if isinstance(message, RolloutGroup):
        return message.prompt
    if isinstance(message, ScoredGroup):
        return message.rollout.prompt
    if isinstance(message, TrainGroup):
        return message.scored.rollout.prompt
    return None


class DeadLetterCredit:
    """The release indices of this run's groups found in its dead letters."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.seen: set[tuple[int, str]] = set()
        """(release index, group id) of every dead-lettered group of this run, as the letters name them."""
        self._sub: Any = None

    def credit(self, released: int, group_id_of: Callable[[int], str]) -> int:
        """Dead-lettered groups this feeder released: an index below `released` with the id it gave that index."""
        return len({i for i, g in self.seen if i < released and g == group_id_of(i)})

    async def start(self) -> DeadLetterCredit:
        t = self.bus.topology
        # The stream named outright: looking it up by subject needs a permission roles do not have.
        self._sub = await self.bus.js.subscribe(
            t.subject("dlq"), stream=t.stream("dlq").name, ordered_consumer=True, cb=self._on
        )
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # tolerated: the subscription may be gone with its connection
                pass

    async def _on(self, msg: Msg) -> None:
        try:
            letter = await open_message(msg.data, msg.headers, self.bus.media)  # a big letter is claim-checked
            if not isinstance(letter, DeadLetter):
                return
            message = await open_message(letter.payload, letter.headers, self.bus.media)
        except Exception:  # deliberate: a letter that is not one of our groups earns no credit
            return
        prompt = _prompt(message)
        if prompt is None or prompt.run != self.bus.run:
            return
        key = (prompt.release_index, prompt.group_id)
        if key not in self.seen:
            self.seen.add(key)
            log.info("dead_letter_seen", group_id=prompt.group_id, release_index=prompt.release_index)

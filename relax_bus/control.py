"""Control exceptions a handler raises to steer what happens to its input message.

The worker loop (`relax_bus.worker`) maps them, in one place, to JetStream acknowledgements:

| raised            | the bus does                                                  |
|-------------------|---------------------------------------------------------------|
| `Retry(delay)`    | nak with delay (redelivered; after max_deliver: dead letter)  |
| `Drop(reason)`    | term with the reason; counted; a `message_dropped` event      |
| `Skip()`          | ack without output                                            |
| `Reject(reason)`  | dead letter at once with the reason (bad input: no retry)     |
| output hop full   | held (kept in progress) until the publish fits: back-pressure |
| anything else     | logged with traceback, nak with backoff, dead letter at last  |
"""

from __future__ import annotations


class Retry(Exception):
    """Raised by a handler that cannot finish now; the message is redelivered after `delay` seconds."""

    def __init__(self, delay: float = 1.0, reason: str = "") -> None:
        super().__init__(reason or f"retry in {delay:g}s")
        self.delay = delay
        self.reason = reason


class Drop(Exception):
    """Raised by a handler that refuses a message for good; it is terminated with the reason recorded."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Reject(Exception):
    """Raised by a handler for input that can never succeed; it is dead-lettered at once with the reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Skip(Exception):
    """Raised by a handler that has nothing to do for a message; it is acked without output."""

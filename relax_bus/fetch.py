"""One pull from a durable consumer: at most `n` messages, [] when none came or NATS is away.

nats-py's `fetch(n)` first empties the subscription's pending queue, whatever its length: messages that
a pull request of an earlier fetch brought in after that fetch gave up (a request the server still
held, typically across a reconnect or a leader election) all come back, more than `n`. A caller that
counts (a trainer's step of B groups) would then take B+1 groups into one step and wait forever for
the last one. Here the surplus is handed back at once (nak: redelivered to the next pull), so a caller
gets what it asked for and nothing is held that no one will settle.
"""

from __future__ import annotations

import asyncio

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from relax_bus.log import get_logger
from relax_bus.outage import TRANSIENT_FETCH

log = get_logger(__name__)

OUTAGE_PAUSE_S = 0.5
"""How long a pull waits after NATS said it is away or electing a leader, so a loop does not spin."""


async def fetch_at_most(
    sub: JetStreamContext.PullSubscription, n: int, timeout_s: float, *, keep_surplus: bool = False
) -> list[Msg]:
    """Up to `n` messages from `sub` within `timeout_s`; [] on a timeout or a transient outage.

    `keep_surplus`: return everything that came (for a reader that takes any number and must see the
    stream in order: a surplus handed back could come again behind newer messages)."""
    try:
        msgs = await sub.fetch(n, timeout=timeout_s)
    except (nats.errors.TimeoutError, TimeoutError):
        return []  # nats-py raises either type when a fetch finds nothing (it never returns [])
    except TRANSIENT_FETCH as err:
        # Tolerated: NATS is away or electing a leader (503); a later pull works again.
        log.info("fetch_interrupted", error=type(err).__name__)
        await asyncio.sleep(OUTAGE_PAUSE_S)
        return []
    if len(msgs) > n and not keep_surplus:
        surplus = msgs[n:]
        log.info("fetch_surplus_returned", asked=n, got=len(msgs))
        await asyncio.gather(*(_nak(m) for m in surplus))
        msgs = msgs[:n]
    return msgs


async def _nak(msg: Msg) -> None:
    try:
        await msg.nak()
    except nats.errors.Error:
        pass  # tolerated: the connection is away; the message comes back after ack_wait instead

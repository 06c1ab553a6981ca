"""Settling a JetStream message outside the happy path: terminate with a reason, or dead-letter it.

Shared by the worker loop and by roles with loops of their own (the actor).
"""

from __future__ import annotations

import nats.errors
from nats.aio.msg import Msg

from relax_bus.bus import Bus
from relax_bus.log import get_logger
from schemas import DeadLetter

log = get_logger(__name__)


async def term(bus: Bus, msg: Msg, reason: str) -> None:
    """Terminate a message (no redelivery) with `reason` recorded in the server's advisory."""
    # msg.term() cannot carry a reason; the protocol's "+TERM <reason>" records it.
    if msg.reply:
        await bus.nc.publish(msg.reply, b"+TERM " + reason[:512].encode())
        msg._ackd = True


async def dead_letter(bus: Bus, msg: Msg, reason: str, consumer: str) -> bool:
    """Store the message with `reason` on the run's dlq subject, then terminate it.

    Returns False (and naks the message for a later retry) when the dead letter could not be stored:
    a message is never dropped without a record.
    """
    md = msg.metadata
    letter = DeadLetter(
        run=bus.run,
        reason=reason,
        source_subject=msg.subject,
        stream_seq=md.sequence.stream,
        deliveries=md.num_delivered,
        consumer=consumer,
        headers={k: str(v) for k, v in (msg.headers or {}).items()},
        payload=msg.data,
    )
    try:
        await bus.publish("dlq", letter)
    except Exception as err:  # tolerated: without a dead letter stored, the message must stay
        log.error("dead_letter_failed", reason=reason, error=str(err))
        try:
            await msg.nak(delay=5.0)
        except (nats.errors.Error, OSError):
            pass  # tolerated: the server redelivers after ack_wait anyway
        return False
    await term(bus, msg, reason)
    log.warning("message_dead_lettered", subject=msg.subject, seq=md.sequence.stream, reason=reason)
    return True

"""Settling a JetStream message outside the happy path: terminate with a reason, or dead-letter it;
and releasing the claim-check object of a work-queue message once it is settled.

Shared by the worker loop and by roles with loops of their own (the actor).

A claim-checked message owns its media object (`relax_bus.envelope`). Once the server confirms that
its consumer acked or terminated it, the message has left its work-queue stream and nobody reads the
object again, so it is deleted at once. A dead-lettered message keeps its object: the dead letter
copies the claim headers, and the feeder and `relax inspect` read the payload through them. The train
stream keeps its messages for replay, so its consumer never releases (it is not a work queue). What
escapes (an ack whose confirmation was lost, a worker killed between the ack and the delete) ages out
with `bus.media_max_age_s`.
"""

from __future__ import annotations

import nats.errors
from nats.aio.msg import Msg

from relax_bus.bus import Bus
from relax_bus.envelope import claim_object
from relax_bus.log import get_logger
from schemas import DeadLetter

log = get_logger(__name__)

CONFIRM_S = 5.0
"""How long the settle of a claim-checked message waits for the server to confirm it (then keeps the object)."""


async def ack(bus: Bus, msg: Msg, release: bool = False) -> None:
    """Acknowledge a message; with `release` (its stream is a work queue), a claim-checked one is acknowledged
    with a confirmation and its claim object deleted."""
    name = claim_object(msg.headers) if release else None
    if name is None:
        await msg.ack()
        return
    try:
        await msg.ack_sync(timeout=CONFIRM_S)
    except (nats.errors.Error, OSError, TimeoutError) as err:
        # Tolerated: the ack may not have landed; a redelivery would still need the object, which ages out.
        log.warning("ack_unconfirmed", subject=msg.subject, claim=name, error=type(err).__name__)
        return
    await release_claim(bus, name)


async def term(bus: Bus, msg: Msg, reason: str, release: bool = False) -> None:
    """Terminate a message (no redelivery) with `reason` recorded in the server's advisory; with `release`, as
    for `ack`, a claim-checked one is terminated with a confirmation and its claim object deleted."""
    if not msg.reply:
        return
    # msg.term() cannot carry a reason; the protocol's "+TERM <reason>" records it.
    data = b"+TERM " + reason[:512].encode()
    name = claim_object(msg.headers) if release else None
    if name is None:
        await bus.nc.publish(msg.reply, data)
        msg._ackd = True
        return
    try:
        await bus.nc.request(msg.reply, data, timeout=CONFIRM_S)
    except (nats.errors.Error, OSError, TimeoutError) as err:
        log.warning("term_unconfirmed", subject=msg.subject, claim=name, error=type(err).__name__)  # as in `ack`
        return
    finally:
        msg._ackd = True  # sent (its confirmation aside): the message is settled
    await release_claim(bus, name)


async def release_claim(bus: Bus, name: str) -> None:
    """Delete a settled message's claim object from the media store."""
    try:
        await bus.media.delete(name)
    except Exception as err:  # tolerated: the object ages out of the media store (bus.media_max_age_s)
        log.warning("claim_not_deleted", claim=name, error=f"{type(err).__name__}: {err}")


async def dead_letter(bus: Bus, msg: Msg, reason: str, consumer: str) -> bool:
    """Store the message with `reason` on the run's dlq subject, then terminate it.

    Returns False (and naks the message for a later retry) when the dead letter could not be stored:
    a message is never dropped without a record. A claim-checked message keeps its object: the letter
    refers to it through the copied headers.
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

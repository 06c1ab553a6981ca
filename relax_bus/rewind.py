"""Rewinding a durable consumer, so that what it delivered and was not settled for good comes again.

Two readers rewind their role's durable when they start: the trainer's batch loop, to the ack floor
recorded with the checkpoint it restarts from (the steps after it are trained again), and the metrics
follower, to just after the durable's own ack floor (events delivered to a process that died before
acknowledging them come again at once and in order, not after `ack_wait` behind newer ones). Both ride
through an outage; the role needs the `resets_consumer` grant (`relax_bus.chain.Grants`).
"""

from __future__ import annotations

from relax_bus.bus import Bus
from relax_bus.log import get_logger
from relax_bus.outage import through_outage

log = get_logger(__name__)


async def ack_floor(bus: Bus, stream: str, durable: str) -> int:
    """The stream sequence of the durable's ack floor (0 before anything was acknowledged)."""
    info = await through_outage(lambda: bus.js.consumer_info(stream, durable), f"read the {durable} consumer")
    return int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0


async def rewind_durable(bus: Bus, stream: str, durable: str, seq: int | None = None) -> int:
    """Make the durable deliver from stream sequence `seq` on (None: just after its ack floor); return `seq`."""
    if seq is None:
        seq = await ack_floor(bus, stream, durable) + 1
    start = seq
    await through_outage(lambda: bus.js.reset_consumer(stream, durable, seq=start), f"rewind the {durable} consumer")
    log.info("consumer_rewound", stream=stream, durable=durable, from_seq=start)
    return start

"""The worker loop. A role supplies a typed handler; the bus owns everything else.

Fetch in batches from the role's durable consumer, resolve claim checks, decode, call the handler
(keeping the message alive with `in_progress()` while it runs), publish what it returns to the
role's output subject, then ack. Control exceptions (`relax_bus.control`) and failures are mapped
to nak / term / dead letter in `_settle`, the one place that decides; an output hop that is full
holds the input in progress until the publish fits (back-pressure, never a failure). SIGTERM stops fetching,
lets in-flight handlers finish within a grace period (naks the rest) and drains the connection. The heartbeat,
`stop()`, signals and running until the role's stop event is set come from the loop base (`relax_bus.loop`),
which the batch shape (`relax_bus.batch_worker`) shares through this class.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import asdict
from typing import Generic, cast

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from relax_bus.bus import Bus
from relax_bus.cancel import cancel_and_wait
from relax_bus.control import Drop, Reject, Retry, Skip
from relax_bus.delivery import Counters, Delivery, Handler, HandlerResult, In, WorkerOptions, foreign_subject
from relax_bus.envelope import open_message
from relax_bus.errors import BlobCorrupt, BlobNotFound, StreamFull
from relax_bus.fetch import fetch_at_most
from relax_bus.log import get_logger
from relax_bus.loop import Loop
from relax_bus.settle import ack, dead_letter, term
from schemas import GROUP_MESSAGES, DeadLetter, Message, RunEvent, SchemaError

__all__ = ["Counters", "Delivery", "Handler", "HandlerResult", "Worker", "WorkerOptions"]

log = get_logger(__name__)


class Worker(Loop, Generic[In]):
    """Runs one role's handler against the run's bus."""

    def __init__(
        self,
        bus: Bus,
        role: str,
        handler: Handler[In],
        input_type: type[In],
        options: WorkerOptions | None = None,
    ) -> None:
        super().__init__(bus, role, options)
        self.role = bus.topology.role(role)
        if self.role.input is None:
            raise ValueError(f"role {role!r} consumes nothing; it needs its own loop, not a Worker")
        self.handler = handler
        self.input_type = input_type
        self.stream = bus.topology.stream(self.role.input)
        self.consumer = bus.topology.consumer(self.role.input)
        # A settled work-queue message is gone from its stream, so its claim object can go too (`relax_bus.settle`);
        # the train stream keeps its messages (and so their objects) for replay.
        self.releases_claims = self.stream.retention == "workqueue"
        # Message size estimate that sizes each pull: rises at once to any bigger message, decays slowly,
        # and starts high so the first pull of an unknown stream stays small in bytes.
        self._avg_size = 256 * 1024.0
        self._working: dict[int, Msg] = {}  # id(message) -> message, from delivery until it is settled

    @contextlib.asynccontextmanager
    async def _consuming(self) -> AsyncIterator[JetStreamContext.PullSubscription]:
        """The consuming loop's surroundings, whatever its shape: the subscription, the keep-alive of
        unsettled messages, the reaper of messages nobody settled (roles granted it), logs."""
        sub = await self.bus.js.pull_subscribe_bind(self.consumer.durable, self.stream.name)
        keepalive = asyncio.create_task(self._keep_alive(), name="keepalive")
        reaper = None
        if self.role.grants.reaps:
            reaper = await self.bus.nc.subscribe(
                self._advisory_subject,
                queue=f"relax-reaper-{self.consumer.durable}",
                cb=self._reap,
            )
        log.info("worker_started", role=self.role.name, worker=self.worker_id, stream=self.stream.name)
        try:
            yield sub
        finally:
            keepalive.cancel()
            if reaper is not None:
                await quietly(reaper.unsubscribe())
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass  # tolerated: the subscription died with the connection
            log.info("worker_stopped", role=self.role.name, worker=self.worker_id, **asdict(self.counters))

    async def run(
        self, *, until_empty: bool = False, stop: asyncio.Event | None = None, handle_signals: bool = False
    ) -> Counters:
        """Consume until stopped (`stop()`, `stop` set, a signal with `handle_signals`) or, with `until_empty`,
        until the input has nothing pending."""
        async with self.running(stop=stop, handle_signals=handle_signals), self._consuming() as sub:
            await self._consume(sub, until_empty)
        return self.counters

    async def _consume(self, sub: JetStreamContext.PullSubscription, until_empty: bool) -> None:
        inflight: set[asyncio.Task[None]] = set()
        # Refill in chunks: pulling one message per finished handler would cost a round trip each.
        refill = max(1, self.options.concurrency // 8)
        try:
            while not self._stop.is_set():
                free = self.options.concurrency - len(inflight)
                if free < refill:
                    stopping = asyncio.create_task(self._stop.wait())
                    await asyncio.wait({*inflight, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    stopping.cancel()
                    continue
                batch = max(1, min(free, int(self.options.fetch_max_bytes // self._avg_size)))
                msgs = await fetch_at_most(sub, batch, self.options.fetch_timeout_s)
                if not msgs:
                    if until_empty and not inflight and await self._input_drained():
                        break
                    continue
                for msg in msgs:
                    size = len(msg.data) + 512
                    self._avg_size = max(size, self._avg_size + (size - self._avg_size) * 0.1)
                    task = asyncio.create_task(self._handle(msg))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
        finally:
            await self._wind_down(inflight)

    async def _wind_down(self, inflight: set[asyncio.Task[None]]) -> None:
        if not inflight:
            return
        log.info("worker_finishing", in_flight=len(inflight), grace_s=self.options.grace_s)
        _, pending = await asyncio.wait(set(inflight), timeout=self.options.grace_s)
        await asyncio.gather(*(cancel_and_wait(task) for task in pending))

    async def _input_drained(self) -> bool:
        info = await self.bus.js.consumer_info(self.stream.name, self.consumer.durable)
        return not info.num_pending and not info.num_ack_pending

    def _delivery(self, msg: Msg) -> Delivery:
        md = msg.metadata
        return Delivery(
            subject=msg.subject,
            stream_seq=md.sequence.stream,
            deliveries=md.num_delivered,
            last_attempt=md.num_delivered >= self.consumer.max_deliver,
        )

    async def _handle(self, msg: Msg) -> None:
        delivery = self._delivery(msg)
        self.counters.received += 1
        # Kept alive from delivery until settled: a claim check's blob may take longer than ack_wait to fetch.
        self._working[id(msg)] = msg
        try:
            await self._decode_and_handle(msg, delivery)
        except asyncio.CancelledError:  # shutdown past its grace: hand the message back at once
            await quietly(msg.nak())
            raise
        finally:
            self._working.pop(id(msg), None)

    def _foreign(self, msg: Msg) -> str | None:
        """Why a message is not this hop's to handle (`relax_bus.delivery.foreign_subject`)."""
        return foreign_subject(msg.subject, self.stream)

    async def _decode(self, msg: Msg, delivery: Delivery) -> In | None:
        """The delivered message decoded (claim check resolved); None when it was dead-lettered instead: stored
        under a foreign subject, or undecodable."""
        if (foreign := self._foreign(msg)) is not None:
            await self._dead_letter(msg, delivery, foreign)
            return None
        try:
            return cast(In, await open_message(msg.data, msg.headers, self.bus.media, self.input_type))
        except (SchemaError, BlobNotFound, BlobCorrupt) as err:
            await self._dead_letter(msg, delivery, f"undecodable {self.stream.key} message: {err}")
            return None

    async def _decode_and_handle(self, msg: Msg, delivery: Delivery) -> None:
        message = await self._decode(msg, delivery)
        if message is None:
            return
        try:
            outputs = _as_list(await self.handler(message, delivery))
            await self._publish_outputs(outputs)
        except asyncio.CancelledError:
            raise  # settled by _handle
        except BaseException as err:  # every outcome of the handler is settled in one place
            await self._settle(msg, delivery, message, err)
        else:
            await ack(self.bus, msg, release=self.releases_claims)
            self.counters.processed += 1

    async def _publish_outputs(self, outputs: list[Message]) -> None:
        if not outputs:
            return
        if self.role.output is None:
            raise RuntimeError(f"role {self.role.name} has no output subject but its handler returned messages")
        subject = self.bus.topology.subject(self.role.output)
        for out in outputs:
            while True:
                try:
                    await self.bus.publisher.publish(subject, out)
                    break
                except StreamFull as err:
                    # Back-pressure: the output hop is full. The input stays in progress (kept alive) and the
                    # same publish is tried again; a nak would count a delivery and end in the dead letters.
                    self.counters.output_full += 1
                    if self._stop.is_set():
                        raise Retry(1.0, f"stopped while the output was full: {err}") from None
                    log.info("output_full", role=self.role.name, subject=subject)
            self.counters.published += 1

    async def _settle(self, msg: Msg, delivery: Delivery, message: Message, err: BaseException) -> None:
        """Map a handler's exception to nak / term / ack / dead letter."""
        if isinstance(err, Skip):
            self.counters.skipped += 1
            await ack(self.bus, msg, release=self.releases_claims)
        elif isinstance(err, Drop):
            self.counters.dropped += 1
            await term(self.bus, msg, err.reason, release=self.releases_claims)
            await self._event(
                "message_dropped",
                "info",
                reason=err.reason,
                seq=delivery.stream_seq,
                group_id=message.group_id if isinstance(message, GROUP_MESSAGES) else None,
            )
            log.info("message_dropped", role=self.role.name, reason=err.reason, seq=delivery.stream_seq)
        elif isinstance(err, Reject):
            await self._dead_letter(msg, delivery, err.reason)
        elif isinstance(err, Retry):
            if delivery.last_attempt:
                why = err.reason or "handler asked for a retry"
                await self._dead_letter(msg, delivery, f"gave up after {delivery.deliveries} deliveries: {why}")
            else:
                self.counters.retried += 1
                await msg.nak(delay=err.delay)
                log.info(
                    "message_retry",
                    role=self.role.name,
                    delay=err.delay,
                    seq=delivery.stream_seq,
                    deliveries=delivery.deliveries,
                )
        elif isinstance(err, Exception):
            self.counters.failed += 1
            log.error(
                "handler_failed",
                role=self.role.name,
                seq=delivery.stream_seq,
                deliveries=delivery.deliveries,
                exc_info=err,
            )
            if delivery.last_attempt:
                reason = f"failed {delivery.deliveries} times, last: {type(err).__name__}: {err}"
                await self._dead_letter(msg, delivery, reason)
            else:
                backoff = self.options.retry_backoff_s
                await msg.nak(delay=backoff[min(delivery.deliveries, len(backoff)) - 1])
        else:
            await quietly(msg.nak())
            raise err

    async def _dead_letter(self, msg: Msg, delivery: Delivery, reason: str) -> None:
        if await dead_letter(self.bus, msg, reason, self.consumer.durable):
            self.counters.dead_lettered += 1

    @property
    def _advisory_subject(self) -> str:
        return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.stream.name}.{self.consumer.durable}"

    async def _reap(self, advisory: Msg) -> None:
        """Dead-letter a message whose last delivery was never settled (its worker crashed or hung).

        The server stops redelivering such a message but keeps it in the work queue; one worker of the
        role (a queue group) moves it to the dead-letter subject and deletes it from the stream. Only the
        server publishes advisories (no role may publish on `$JS.EVENT`, nor create a consumer that would
        deliver there); even so the advisory must name this durable, on its own subject, past its
        `max_deliver`, and the message must be one of this hop's.
        """
        try:
            info = json.loads(advisory.data)
            seq, deliveries = int(info["stream_seq"]), int(info.get("deliveries", 0))
            ours = (info.get("stream"), info.get("consumer")) == (self.stream.name, self.consumer.durable)
            if advisory.subject != self._advisory_subject or not ours or deliveries < self.consumer.max_deliver:
                log.warning("advisory_refused", subject=advisory.subject, advisory=advisory.data[:200])
                return
            raw = await self.bus.js.get_msg(self.stream.name, seq)
        except (ValueError, KeyError, TypeError, AttributeError, nats.js.errors.NotFoundError):
            return  # tolerated: unreadable advisory, or the message was settled meanwhile
        except nats.errors.Error as err:
            log.warning("reap_failed", seq=advisory.data[:80], error=str(err))
            return
        if raw.subject != self.stream.subject:
            log.warning("advisory_refused", seq=seq, why=f"message under {raw.subject}, not the hop's subject")
            return
        reason = f"not settled after {deliveries} deliveries (its worker crashed, hung or was stopped)"
        letter = DeadLetter(
            run=self.bus.run,
            reason=reason,
            source_subject=raw.subject or self.stream.subject,
            stream_seq=seq,
            deliveries=deliveries,
            consumer=self.consumer.durable,
            headers={k: str(v) for k, v in (raw.headers or {}).items()},
            payload=raw.data or b"",
        )
        try:
            await self.bus.publish("dlq", letter)
            await self.bus.js.delete_msg(self.stream.name, seq)
        except Exception as err:  # tolerated: the message stays in the stream for `relax inspect` to show
            log.error("reap_failed", seq=seq, error=str(err))
            return
        self.counters.dead_lettered += 1
        log.warning("message_dead_lettered", role=self.role.name, seq=seq, reason=reason)

    async def _keep_alive(self) -> None:
        """Every ack_wait/4, tell the server that every message not yet settled is still in progress.

        Every held message is touched on every tick, so one is first touched at most ack_wait/4 after its
        delivery and the loop may stall for up to 3/4 of ack_wait (a loaded machine) without a redelivery.
        """
        interval = max(0.1, self.consumer.ack_wait_s / 4)
        while True:
            await asyncio.sleep(interval)
            for msg in list(self._working.values()):
                await quietly(msg.in_progress())

    async def _event(self, event: str, level: str, **fields: str | int | float | None) -> None:
        try:
            await self.bus.publish(
                "events",
                RunEvent(run=self.bus.run, event=event, level=level, source=self.worker_id, fields=fields),
            )
        except Exception as err:  # tolerated: events are informative; the counters still hold the truth
            log.warning("event_lost", name=event, error=str(err))


def _as_list(result: HandlerResult) -> list[Message]:
    if result is None:
        return []
    if isinstance(result, Message):
        return [result]
    return list(result)


async def quietly(aw: Awaitable[object]) -> None:
    """Await a settle or unsubscribe whose failure the server makes up for (it redelivers after ack_wait)."""
    try:
        await aw
    except (nats.errors.Error, OSError):
        pass  # tolerated: the connection is gone; the server redelivers after ack_wait

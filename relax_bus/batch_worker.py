"""The batch shape of the worker loop: hold up to B admitted messages, handle them once, settle them together.

For a role whose unit of work is a batch (the trainer's step). A reader task fetches and decodes the input as it
arrives, and with `read_ahead` up to one batch ahead of the batch being collected, so the next batch's messages are
decoded while the current one is handled (an undecodable one is dead-lettered there). The loop takes them in stream
order and asks the role's `admit(message, delivery, held)` with the role's state as the previous batch left it;
`admit` may raise the control exceptions, settled where the worker loop settles everything (`Worker._settle`):
`Skip` acks (a copy already handled), `Drop` terminates with the reason (a stale group), `Reject` dead-letters.
Returning holds the message for the batch. Held and read-ahead messages are kept alive until settled. With B held
(or, given `flush_idle_s`, fewer once nothing has arrived for that long), `handle(batch)` runs once; then every held
message is acked, without waiting for the server's confirmation (an ack that is lost brings its message back, and
`admit` must recognise it as a copy); then `settled(batch)` runs (what must follow the acks: step records,
checkpoints). `handle` may give the whole batch a verdict instead: `Reject` dead-letters every held message with its
reason (`Drop` terminates them), and the loop goes on with the next batch (`settled` is not called). A stop, or any
other failure of `handle`, hands the held and the read-ahead messages back (nak) for redelivery. A role that
restarts from a checkpoint first rewinds the durable (`rewind`) to the ack floor recorded with it, so what followed
comes again.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from relax_bus.bus import Bus
from relax_bus.cancel import cancel_and_wait
from relax_bus.control import Drop, Reject
from relax_bus.delivery import Counters, Delivery, In, WorkerOptions
from relax_bus.errors import NatsUnavailable
from relax_bus.fetch import fetch_at_most
from relax_bus.log import get_logger
from relax_bus.outage import through_outage
from relax_bus.rewind import rewind_durable
from relax_bus.worker import Worker, quietly

log = get_logger(__name__)

ACK_OUTAGE_S = 15.0
"""How long the ack of a handled message is retried through an outage; past that its redelivery is
the role's to recognise (`admit` raising `Skip`)."""


@dataclass(frozen=True)
class Held(Generic[In]):
    """One admitted message of the batch being collected."""

    message: In
    delivery: Delivery
    msg: Msg


class BatchRole(Protocol[In]):
    """What a batch role supplies; the bus owns fetching, settling, keep-alive and shutdown."""

    async def admit(self, message: In, delivery: Delivery, held: Sequence[Held[In]]) -> None:
        """Return to hold the message for the batch; raise `Skip` / `Drop` / `Reject` to settle it now."""

    async def handle(self, batch: Sequence[Held[In]]) -> None:
        """Handle a full batch; every message of it is acked when this returns, dead-lettered when it raises
        `Reject` (terminated on `Drop`)."""

    async def settled(self, batch: Sequence[Held[In]]) -> None:
        """After the batch's acks (records that must follow them); may call `BatchWorker.stop`."""


class BatchWorker(Worker[In]):
    """Runs a `BatchRole` against its role's durable consumer, `size()` messages per batch."""

    def __init__(
        self,
        bus: Bus,
        role: str,
        batch_role: BatchRole[In],
        input_type: type[In],
        size: Callable[[], int],
        options: WorkerOptions | None = None,
        read_ahead: bool = True,
        flush_idle_s: float | None = None,
    ) -> None:
        super().__init__(bus, role, _no_handler, input_type, options)
        self.batch_role = batch_role
        self.size = size
        self.read_ahead = read_ahead
        """Read the next batch while one is handled (off when `handle` needs every core the reader would use)."""
        self.flush_idle_s = flush_idle_s
        """Handle a partial batch once nothing has arrived for this long (None: always wait for a whole one)."""
        self.timings: collections.defaultdict[str, float] = collections.defaultdict(float)
        """Seconds spent waiting for data, admitting and acking (the loop's own path), and decoding (the reader,
        beside it), since the role last reset it."""
        self._ready: collections.deque[Held[In]] = collections.deque()
        """Messages read and decoded, not yet admitted (the rest of the batch being collected, and the next one)."""
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._held: list[Held[In]] = []
        """The batch being collected or handled."""

    def stop(self) -> None:
        super().stop()
        self._arrived.set()
        self._room.set()

    async def rewind(self, seq: int | None = None) -> int:
        """Rewind the role's durable so delivery starts again at stream sequence `seq` (None: just after its ack
        floor), before `run`: a role restarting from a checkpoint replays what followed it. Returns `seq`."""
        return await rewind_durable(self.bus, self.stream.name, self.consumer.durable, seq)

    async def run(
        self, *, until_empty: bool = False, stop: asyncio.Event | None = None, handle_signals: bool = False
    ) -> Counters:
        """Collect, handle and settle batches until stopped (`until_empty` has no meaning here: a batch
        role waits for a whole batch)."""
        if until_empty:
            raise ValueError("a BatchWorker runs until stopped; until_empty is for per-message workers")
        async with self.running(stop=stop, handle_signals=handle_signals), self._consuming() as sub:
            halt = asyncio.Event()
            reader = self._reader = asyncio.create_task(self._read(sub, halt), name="read-ahead")
            reader.add_done_callback(lambda _: self._arrived.set())  # a failed reader wakes `_collect`
            try:
                await self._batches()
            except asyncio.CancelledError:
                await cancel_and_wait(reader)
                raise
            finally:
                # The reader's pull in flight ends within fetch_timeout_s; only then is everything it brought in
                # handed back (a pull cut short would leave its messages to come back after ack_wait).
                halt.set()
                self._room.set()
                await asyncio.wait({reader})
                back = [*self._held, *self._ready]
                self._held, self._ready = [], collections.deque()
                await self._hand_back(back)
            reader.result()  # a reader that failed after the last batch
        return self.counters

    async def _batches(self) -> None:
        while not self._stop.is_set():
            held: list[Held[In]] = []
            self._held = held
            if not await self._collect(held):
                break
            try:
                await self.batch_role.handle(held)  # on another failure `run` hands the batch back
            except (Reject, Drop) as verdict:
                self._held = []
                self._room.set()
                await self._settle_batch(held, verdict)
                continue
            self._held = []
            self._room.set()  # the next batch is the one to read now
            for h in held:
                self._working.pop(id(h.msg), None)
            started = time.perf_counter()
            for h in held:
                await self._ack(h.msg)
            self.timings["ack_s"] += time.perf_counter() - started
            self.counters.processed += len(held)
            await self.batch_role.settled(held)

    def _wanted(self) -> int:
        """How many messages to pull now: the rest of the batch being collected first, then the next batch.

        A pull returns once it has all it asked for (or at its timeout), so it never asks for more than the batch
        in hand can use: the next batch's groups may only come once this one is handled (on-policy), and the
        rest of this one would wait inside the pull until then."""
        size, ahead = self.size(), len(self._held) + len(self._ready)
        if (rest := size - ahead) > 0 or not self.read_ahead:
            return rest
        return 2 * size - ahead

    async def _read(self, sub: JetStreamContext.PullSubscription, halt: asyncio.Event) -> None:
        """Keep the batch being collected, and then the next one, read and decoded, until halted (or stopped)."""
        while not (halt.is_set() or self._stop.is_set()):
            room = self._wanted()
            if room <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            fetched = await fetch_at_most(sub, room, self.options.fetch_timeout_s)
            for msg in fetched:  # kept alive from now on, also while the ones before them are decoded
                self._working[id(msg)] = msg
            for msg in fetched:
                started = time.perf_counter()
                opened = await self._open(msg)
                self.timings["decode_s"] += time.perf_counter() - started
                if opened is not None:
                    self._ready.append(opened)
                    self._arrived.set()

    async def _collect(self, held: list[Held[In]]) -> bool:
        """Fill `held` with a batch (with `flush_idle_s`, what is held once the input has been idle that long); False
        when stopped first."""
        started = time.perf_counter()
        while len(held) < self.size():
            if self._stop.is_set():
                return False  # `run` hands the held messages back
            if not self._ready:
                if self._reader is not None and self._reader.done():
                    self._reader.result()  # the reader failed: raise its error here
                    raise RuntimeError("the read-ahead task ended while a batch was being collected")
                self._arrived.clear()
                if not held or self.flush_idle_s is None:
                    await self._arrived.wait()
                    continue
                try:
                    await asyncio.wait_for(self._arrived.wait(), self.flush_idle_s)
                except TimeoutError:
                    break  # the input ran dry: the batch is what is held
                continue
            opened = self._ready.popleft()
            self._room.set()
            admit_started = time.perf_counter()
            if await self._admit(opened, held):
                held.append(opened)
            self.timings["admit_s"] += time.perf_counter() - admit_started
        self.timings["data_wait_s"] += time.perf_counter() - started
        return True

    async def _open(self, msg: Msg) -> Held[In] | None:
        """Decode a delivered message; None when it was dead-lettered instead."""
        delivery = self._delivery(msg)
        self.counters.received += 1
        self._working[id(msg)] = msg  # kept alive from delivery until settled
        message = await self._decode(msg, delivery)
        if message is None:
            self._working.pop(id(msg), None)
            return None
        return Held(message, delivery, msg)

    async def _admit(self, opened: Held[In], held: list[Held[In]]) -> bool:
        """Ask the role; True when it holds the message for the batch (otherwise it is settled here)."""
        try:
            await self.batch_role.admit(opened.message, opened.delivery, held)
        except asyncio.CancelledError:
            self._working.pop(id(opened.msg), None)
            await quietly(opened.msg.nak())
            raise
        except BaseException as err:  # every outcome is settled in one place
            self._working.pop(id(opened.msg), None)
            await self._settle(opened.msg, opened.delivery, opened.message, err)
            return False
        return True

    async def _settle_batch(self, held: Sequence[Held[In]], verdict: Reject | Drop) -> None:
        """Settle every message of a batch with the verdict `handle` gave it (dead letter, or term)."""
        log.warning("batch_settled_unhandled", role=self.role.name, messages=len(held), reason=verdict.reason)
        for h in held:
            self._working.pop(id(h.msg), None)
            await self._settle(h.msg, h.delivery, h.message, verdict)

    async def _hand_back(self, held: Sequence[Held[In]]) -> None:
        """Nak messages this worker will not handle, for redelivery."""
        for h in held:
            self._working.pop(id(h.msg), None)
        await asyncio.gather(*(quietly(h.msg.nak()) for h in held))

    async def _ack(self, msg: Msg) -> None:
        try:
            await through_outage(msg.ack, "ack a handled message", deadline_s=ACK_OUTAGE_S)
        except NatsUnavailable:
            pass  # tolerated: an ack lost with a server restart brings the message back; `admit` skips it


async def _no_handler(message: object, delivery: Delivery) -> None:
    raise AssertionError("a BatchWorker calls its BatchRole, never a per-message handler")

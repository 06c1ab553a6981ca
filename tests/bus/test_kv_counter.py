"""KV counters (compare-and-set, read-back after a lost answer) and the run state riding an outage, against a
real server."""

import asyncio
import time
from typing import Any

import nats.errors
import pytest

from relax_bus.errors import CasConflict, VersionConflict
from relax_bus.kv_counter import KvCounter

pytestmark = pytest.mark.bus


class LosesAnswers:
    """The state bucket, but the next write's answer is lost: after it landed (`lands`) or before."""

    def __init__(self, kv: Any, lands: bool, then: Any = None) -> None:
        self.kv, self.lands, self.then, self.lost = kv, lands, then, 0

    async def get(self, key: str) -> Any:
        return await self.kv.get(key)

    async def create(self, key: str, value: bytes) -> int:
        return await self._write(lambda: self.kv.create(key, value))

    async def update(self, key: str, value: bytes, last: int) -> int:
        return await self._write(lambda: self.kv.update(key, value, last=last))

    async def _write(self, write: Any) -> int:
        if self.lost:
            return await write()
        self.lost += 1
        if self.lands:
            await write()
        if self.then is not None:
            await self.then()  # another writer, in the window before the read-back
        raise nats.errors.TimeoutError


async def test_get_cas_and_add(bus):
    counter = KvCounter(bus.state, "test.counter")
    assert await counter.get() == (0, 0)
    rev1 = await counter.cas(5, 0)
    assert await counter.get() == (5, rev1)
    rev2 = await counter.cas(6, rev1)
    with pytest.raises(CasConflict):
        await counter.cas(7, rev1)  # a writer that read before the last write
    with pytest.raises(VersionConflict):
        await counter.cas(7, 0)  # creating again is a conflict too
    assert await counter.add(4) == 10
    value, revision = await counter.get()
    assert value == 10 and revision > rev2
    assert (await bus.state.get("test.counter")).value == b"10"  # readable text, as every run-state value


async def test_a_write_whose_answer_was_lost_is_recognised_by_reading_back(bus):
    rev = await KvCounter(bus.state, "test.cursor").cas(1, 0)
    landed = LosesAnswers(bus.state, lands=True)
    rev2 = await KvCounter(landed, "test.cursor").cas(2, rev)
    assert landed.lost == 1 and await KvCounter(bus.state, "test.cursor").get() == (2, rev2)
    missed = LosesAnswers(bus.state, lands=False)
    rev3 = await KvCounter(missed, "test.cursor").cas(3, rev2)
    assert missed.lost == 1 and await KvCounter(bus.state, "test.cursor").get() == (3, rev3)


async def test_a_lost_answer_and_another_writer_is_a_conflict(bus):
    rev = await KvCounter(bus.state, "test.cursor").cas(1, 0)

    async def second_writer() -> None:
        await bus.state.update("test.cursor", b"7", last=rev)

    raced = LosesAnswers(bus.state, lands=False, then=second_writer)
    with pytest.raises(CasConflict) as caught:
        await KvCounter(raced, "test.cursor").cas(2, rev)
    assert caught.value.current == 7


async def test_run_state_rides_through_a_server_restart(bus, nats_server):
    assert await bus.run_state.get("test.record") is None
    await bus.run_state.put("test.record", b"one")
    rev = await bus.run_state.cas("test.count", 1, 0)

    def restart_later() -> None:
        time.sleep(1.0)  # the server is away while the writes below are made
        nats_server.start()  # same port, same store dir: the bucket survives

    nats_server.stop()
    restart = asyncio.create_task(asyncio.to_thread(restart_later))
    try:
        await bus.run_state.put("test.record", b"two")  # waits for the server instead of failing
        assert await bus.run_state.get("test.record") == b"two"
        await bus.run_state.cas("test.count", 2, rev)
        assert (await bus.run_state.count("test.count"))[0] == 2
    finally:
        await restart

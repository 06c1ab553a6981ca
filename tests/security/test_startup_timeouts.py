"""Finding 6: a role starting while its server is too loaded to answer JetStream requests in time exited 1 with a
traceback (`read_config` -> `state_kv` -> `stream_info` raising `nats.errors.TimeoutError`), while an unreachable
server was waited for. The start-up reads now ride through such timeouts the way a connection rides an outage.

The server is frozen with SIGSTOP (by its PID) while `Bus.attach` reads the run: every request times out, as
under load; thawed a few seconds later, the same attach completes."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from relax_bus.bus import Bus
from relax_bus.connection import connect
from tests.waiting import until
from workers.config import PipelineConfig

pytestmark = pytest.mark.bus


def state(pid: int) -> str:
    """The process's state letter (R, S, T, ...) from /proc."""
    return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]


async def test_a_role_starting_against_a_frozen_server_waits_for_it_instead_of_failing(bus, settings, nats_server):
    nc = await connect(settings, name="late-role")
    pid = nats_server.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            await until(lambda: state(pid), lambda s: s == "T", 10, "the server stopped")
            attaching = asyncio.create_task(Bus.attach(nc, bus.run, PipelineConfig))
            await asyncio.sleep(12)  # longer than a JetStream request's 10 s timeout: at least one timed out
            assert not attaching.done(), "attach neither failed nor finished while the server was frozen"
        finally:
            os.kill(pid, signal.SIGCONT)
        attached = await asyncio.wait_for(attaching, 60)
        assert attached.config.run == bus.run
    finally:
        await nc.close()

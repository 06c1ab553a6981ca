"""Worker processes that die or are told to stop, with messages in flight."""

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bus.test_publish import read_all
from tests.bus.test_worker import consumer_state, echo, publish_prompts, rollout_worker
from tests.waiting import until

pytestmark = pytest.mark.bus
ROOT = Path(__file__).resolve().parents[2]


def start_worker(nats_server, run, log, **opts):
    cmd = [
        sys.executable,
        "-m",
        "tests.bus.worker_proc",
        "--nats-url",
        nats_server.url,
        "--run",
        run,
        "--log",
        str(log),
    ]
    for k, v in opts.items():
        cmd += [f"--{k}", str(v)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def wait_for_lines(log: Path, prefix: str, n: int, proc, timeout_s=20.0) -> list[str]:
    """The log's lines starting with `prefix`, once there are `n`; fails at once when the worker exited short."""

    def lines() -> list[str]:
        found = [ln for ln in (log.read_text().splitlines() if log.exists() else []) if ln.startswith(prefix)]
        if len(found) < n and proc.poll() is not None:
            raise AssertionError(f"worker exited early ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
        return found

    return await until(lines, lambda found: len(found) >= n, timeout_s, what=f"{n} '{prefix}' lines in {log}")


def stop(proc):
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


async def test_sigkill_with_messages_in_flight_loses_nothing(make_bus, nats_server, tmp_path):
    bus = await make_bus(bus={"ack_wait_s": 2.0})
    await publish_prompts(bus, 6)
    log = tmp_path / "a.log"
    victim = start_worker(nats_server, bus.run, log, sleep=60, concurrency=4)
    try:
        await wait_for_lines(log, "start", 4, victim)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
    finally:
        stop(victim)
    assert (await consumer_state(bus)).num_ack_pending == 4

    counters = await rollout_worker(bus, echo, concurrency=6).run(until_empty=True)

    assert counters.processed == 6
    outs = await read_all(bus, "rollouts")
    assert sorted(o.prompt.group_id for o in outs) == [f"g{i}" for i in range(6)]
    state = await consumer_state(bus)
    assert state.num_pending == 0 and state.num_ack_pending == 0 and state.num_redelivered == 0
    assert (await bus.js.stream_info(bus.topology.stream("prompts").name)).state.messages == 0


async def test_sigterm_finishes_in_flight_work_and_exits_zero(make_bus, nats_server, tmp_path):
    bus = await make_bus()
    await publish_prompts(bus, 3)
    log = tmp_path / "b.log"
    proc = start_worker(nats_server, bus.run, log, sleep=1.5, concurrency=3)
    try:
        await wait_for_lines(log, "start", 3, proc)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        stop(proc)
    assert len(await wait_for_lines(log, "done", 3, proc)) == 3
    assert sorted(o.prompt.group_id for o in await read_all(bus, "rollouts")) == ["g0", "g1", "g2"]
    state = await consumer_state(bus)
    assert state.num_pending == 0 and state.num_ack_pending == 0


async def test_sigterm_past_grace_hands_work_back_at_once(make_bus, nats_server, tmp_path):
    # ack_wait far beyond the test's timeout: only a hand-back (nak) lets the next worker see them in time.
    bus = await make_bus(bus={"ack_wait_s": 900.0, "duplicate_window_s": 1800.0})
    await publish_prompts(bus, 2)
    log = tmp_path / "c.log"
    proc = start_worker(nats_server, bus.run, log, sleep=60, concurrency=2, grace=0.5)
    try:
        await wait_for_lines(log, "start", 2, proc)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        stop(proc)
    # nak'd, not left to time out: the next worker gets both long before ack_wait (900 s) could pass.
    counters = await asyncio.wait_for(rollout_worker(bus, echo, concurrency=2).run(until_empty=True), 60)
    assert counters.processed == 2

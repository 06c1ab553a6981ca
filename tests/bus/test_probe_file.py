"""The heartbeat file the container probes read (`relax_bus.probe`), written by real workers against a real server:
ready while the beats are stored, still live while NATS is away, gone when the worker stops; and `relax worker
--heartbeat-file` clearing a file a previous container left behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_bus.delivery import WorkerOptions
from relax_bus.probe import probe
from relax_bus.worker import Worker
from schemas import PromptGroup
from tests.waiting import holds, until

pytestmark = [pytest.mark.bus, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]


async def test_a_worker_is_ready_while_its_beats_are_stored_and_live_while_nats_is_away(bus, nats_server, tmp_path):
    path = tmp_path / "heartbeat.json"
    bus.heartbeat_file = path  # what `relax worker --heartbeat-file` sets

    async def handle(prompt, delivery):
        return None

    worker = Worker(bus, "rollout", handle, PromptGroup, WorkerOptions(fetch_timeout_s=0.2))
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop=stop))
    try:
        await until(lambda: probe("ready", path), lambda v: v[0], 30, "the worker ready")
        state = json.loads(path.read_text())
        assert state["ttl_s"] == bus.config.bus.heartbeat_ttl_s and state["beat_at"] == state["tried_at"]

        nats_server.stop()  # an outage: the beats are no longer stored, the loop goes on trying
        await until(lambda: probe("ready", path), lambda v: not v[0], 30, "readiness lost with the server")
        ttl = bus.config.bus.heartbeat_ttl_s
        await holds(lambda: probe("live", path), lambda v: v[0], 2 * ttl, "liveness through the outage")
        nats_server.start()
        await until(lambda: probe("ready", path), lambda v: v[0], 60, "ready again once the server is back")
    finally:
        stop.set()
        await asyncio.wait_for(running, 60)
    assert not path.exists()  # stopped: no file, as no bucket entry
    assert probe("live", path)[0] and not probe("ready", path)[0]


async def test_relax_worker_clears_a_stale_file_and_removes_its_own_on_sigterm(bus, nats_server, tmp_path):
    path = tmp_path / "heartbeat.json"
    stale = {"tried_at": 1.0, "beat_at": 1.0, "ttl_s": 2.0, "every_s": 10.0}  # the previous container's last beat
    path.write_text(json.dumps(stale))
    assert not probe("live", path)[0]
    started = time.time()
    args = ["worker", "metrics", "--run", bus.run, "--nats-url", nats_server.url, "--heartbeat-file", str(path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:

        def seen() -> tuple[bool, str]:
            if proc.poll() is not None:
                raise AssertionError(f"the worker exited ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
            return probe("ready", path)

        await until(seen, lambda v: v[0], 60, "the metrics worker ready")
        assert json.loads(path.read_text())["beat_at"] >= started  # its own beat, not the stale one
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert not path.exists()

"""`relax probe ready|live`, the command the Kubernetes probes run: exit 0 or 1 and one line saying why."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_bus.probe import ProbeFile

pytestmark = pytest.mark.cli

TTL = 15.0


def test_relax_probe_exits_0_or_1_and_says_why(tmp_path: Path) -> None:
    path = tmp_path / "hb.json"

    def run(kind: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, "-m", "workers.cli", "probe", kind, "--heartbeat-file", str(path)]
        return subprocess.run(args, capture_output=True, text=True, timeout=60)

    starting = run("ready")
    assert (starting.returncode, starting.stdout) == (1, "ready: no: no heartbeat yet (starting, or stopped)\n")
    assert run("live").returncode == 0
    ProbeFile(path, TTL, TTL).record(tried_at=time.time(), beat_at=None)  # connected to nothing yet
    assert run("ready").returncode == 1 and run("live").returncode == 0
    ProbeFile(path, TTL, TTL).record(tried_at=time.time(), beat_at=time.time())
    ready = run("ready")
    assert ready.returncode == 0 and ready.stdout.startswith("ready: yes: last heartbeat stored 0."), ready.stdout
    ProbeFile(path, TTL, TTL).record(tried_at=time.time() - 3 * TTL, beat_at=time.time() - 3 * TTL)
    stuck = run("live")
    assert stuck.returncode == 1 and stuck.stdout.startswith("live: no: heartbeat loop last ran 4"), stuck.stdout

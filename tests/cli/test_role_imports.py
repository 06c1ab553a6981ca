"""Roles whose code needs no ML library do not load one: `relax worker feeder` and `relax worker reward`
run as real processes against a real server, and report what they imported when they stop."""

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relax_bus.heartbeat import live_workers
from tests.waiting import until

pytestmark = pytest.mark.cli
ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "vllm", "safetensors", "tokenizers", "numpy")
# Runs `relax worker ...` in-process, then prints which heavy modules it had loaded.
WRAPPER = (
    "import sys\n"
    "from workers.cli import main\n"
    "code = main(sys.argv[1:])\n"
    f"print('LOADED', sorted(m for m in {HEAVY!r} if m in sys.modules), flush=True)\n"
    "sys.exit(code)\n"
)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.mark.parametrize("role", ["feeder", "reward"])
async def test_role_runs_without_torch(role, make_bus, settings, tmp_path):
    bus = await make_bus()
    proc = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, "worker", role, "--run", bus.run, "--nats-url", settings.nats_url[0]],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RELAX_CONNECT_RETRY_S": "10"},
    )
    try:
        await until(
            lambda: live_workers(bus.workers), lambda beats: any(b.role == role for b in beats), 60, f"{role} heartbeat"
        )
        rss = rss_mib(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        out, err = await asyncio.to_thread(proc.communicate, timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "LOADED []" in out, out + err[-2000:]
    print(f"{role}: RSS {rss:.0f} MiB while running, no ML library loaded")  # figure for the record, not a gate

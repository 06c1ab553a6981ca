"""A role stopped when its server is gone exits 0 at once, without a traceback.

`compose down` stops every container at the same moment, the NATS server included: a role must not
hang in its last requests (the heartbeat's removal, the connection's flush) or crash on the broken
connection, and one still waiting for its server must stop at SIGTERM (as a container's PID 1, a
process without a handler ignores it and is killed only after the stop grace period).
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relax_bus.ops.server import free_port
from tests.waiting import until

pytestmark = pytest.mark.cli
ROOT = Path(__file__).resolve().parents[2]


def start_worker(role: str, url: str, log: Path, **env: str) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "workers.cli", "--log-level", "info", "worker", role, "--run", "stop", "--nats-url"]
    with log.open("wb") as out:
        return subprocess.Popen(
            [*args, url, "--work-dir", str(log.parent / "work")],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **env},
        )


def stopped(proc: subprocess.Popen[bytes], log: Path) -> tuple[int, str]:
    """SIGTERM `proc` by its PID; its exit code and output once it has exited."""
    os.kill(proc.pid, signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"still running 60 s after SIGTERM; its output:\n{log.read_text()[-3000:]}")
    return code, log.read_text()


@pytest.mark.parametrize(
    ("role", "started", "ended"),
    [("reward", "worker_started", "worker_stopped"), ("metrics", "follower_opened", "metrics_stopped")],
)
async def test_a_role_whose_server_has_gone_stops_cleanly(nats_server, tmp_path, role, started, ended):
    config = tmp_path / "run.yaml"
    config.write_text("run: stop\nmodel: {source: 'tiny:64x2'}\n")
    init = subprocess.run(
        [sys.executable, "-m", "workers.cli", "init", str(config), "--nats-url", nats_server.url],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert init.returncode == 0, init.stderr
    log = tmp_path / f"{role}.log"
    proc = start_worker(role, nats_server.url, log)
    try:
        await until(log.read_text, lambda text: f'"{started}"' in text, 90, f"{role} started")
        nats_server.kill()
        await until(log.read_text, lambda text: '"nats_disconnected"' in text, 60, f"{role} saw the server go")
        code, output = stopped(proc, log)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in output, output[-3000:]
    assert code == 0, output[-3000:]
    assert f'"{ended}"' in output


async def test_a_role_waiting_for_its_server_stops_at_sigterm(tmp_path):
    log = tmp_path / "reward.log"
    proc = start_worker("reward", f"nats://127.0.0.1:{free_port()}", log, RELAX_CONNECT_RETRY_S="600")
    try:
        await until(log.read_text, lambda text: '"nats_connect_retry"' in text, 60, "a first connection attempt")
        code, output = stopped(proc, log)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 0, output[-3000:]
    assert '"role_stopped_before_connecting"' in output

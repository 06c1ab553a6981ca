"""`relax init --wait`: provisioning a server that is still starting (compose starts both at once)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_bus.errors import NatsServerNotFound
from relax_bus.ops.server import EmbeddedServer, free_port

pytestmark = pytest.mark.cli
ROOT = Path(__file__).resolve().parents[2]
REQUIRE_NATS = os.environ.get("CI", "").lower() == "true" or os.environ.get("RELAX_REQUIRE_NATS") == "1"


def test_init_waits_for_a_server_that_starts_later(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("run: waits\ngroups_per_step: 2\nsamples_per_group: 2\n")
    port = free_port()
    try:
        server = EmbeddedServer(port=port, store_dir=tmp_path / "nats")
    except NatsServerNotFound as err:
        if REQUIRE_NATS:
            pytest.fail(f"nats-server is required here but missing: {err}")
        pytest.skip(str(err))
    url = f"nats://127.0.0.1:{port}"
    errors = tmp_path / "init.stderr"
    with errors.open("w") as stderr:
        init = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workers.cli",
                "--log-level",
                "info",
                "init",
                str(config),
                "--nats-url",
                url,
                "--wait",
                "60",
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=ROOT,
        )
    try:
        # The server starts only once init has been refused and is retrying (it says so on stderr).
        deadline = time.monotonic() + 60
        while errors.read_text().count("nats_connect_retry") < 2:
            assert init.poll() is None, f"init exited ({init.returncode}) before retrying:\n{errors.read_text()}"
            assert time.monotonic() < deadline, f"no retries seen in 60s:\n{errors.read_text()}"
            time.sleep(0.05)
        server.start()
        out, _ = init.communicate(timeout=60)
    finally:
        if init.poll() is None:
            init.kill()
            init.wait()
        server.cleanup()
    assert init.returncode == 0, errors.read_text()
    assert "run waits: 19 created" in out, out


def test_init_without_wait_fails_at_once(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("run: nowait\n")
    url = f"nats://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "--log-level", "info", "init", str(config), "--nats-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 75, result  # an outage: worth another attempt (relax_bus.errors.EXIT_TEMPORARY)
    assert "relax: error: cannot reach NATS" in result.stderr, result.stderr
    assert "nats_connect_retry" not in result.stderr, result.stderr  # one attempt, no retries

"""`relax init --wait`: provisioning a server that is still starting (compose starts both at once)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_bus.errors import NatsServerNotFound
from relax_bus.server import EmbeddedServer, free_port

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
    init = subprocess.Popen(
        [sys.executable, "-m", "relax_bus.cli", "init", str(config), "--nats-url", url, "--wait", "30"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        time.sleep(2.0)  # init is retrying against a closed port by now
        assert init.poll() is None, init.communicate()
        server.start()
        out, err = init.communicate(timeout=30)
    finally:
        if init.poll() is None:
            init.kill()
            init.wait()
        server.cleanup()
    assert init.returncode == 0, err
    assert "run waits: 13 created" in out, out


def test_init_without_wait_fails_at_once(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("run: nowait\n")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "relax_bus.cli", "init", str(config), "--nats-url", f"nats://127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert result.returncode == 2, result
    assert result.stderr.startswith("relax: error: cannot reach NATS"), result.stderr
    assert time.monotonic() - started < 15

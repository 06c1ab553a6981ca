"""The README's quick start "Try the bus by hand", run line by line as written (only the port and the
server's store directory are moved to a free port and a temp dir), with the output each line's comment
quotes."""

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

from relax_bus.ops.server import free_port, wait_for_port

pytestmark = pytest.mark.cli
ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "README.md"


def walkthrough() -> list[tuple[str, str | None]]:
    """(command, quoted expected output or None) for each line of the block under "Try the bus by hand"."""
    text = PAGE.read_text()
    block = re.search(r"## Try the bus by hand.*?```bash\n(.*?)```", text, flags=re.S)
    assert block, f"{PAGE.name} has no 'Try the bus by hand' block"
    lines = []
    for line in block.group(1).splitlines():
        command, _, comment = line.partition("#")
        quoted = re.search(r'"([^"]+)"', comment)
        lines.append((command.strip(), quoted.group(1) if quoted else None))
    return lines


def test_the_bus_walkthrough_runs_as_written(tmp_path):
    steps = walkthrough()
    assert [c.split()[1] for c, _ in steps if c.startswith(".venv/bin/relax")] == [
        "server", "init", "init", "inspect", "inspect", "config"
    ], steps  # fmt: skip
    port = free_port()
    env = {**os.environ, "RELAX_NATS_URL": f"nats://127.0.0.1:{port}"}
    server = None
    try:
        for command, expected in steps:
            if command.startswith("make "):
                continue  # the suite runs inside the installed venv already
            args = shlex.split(command.rstrip("&").replace("--port 4222", f"--port {port}"))
            if command.endswith("&"):
                args += ["--store-dir", str(tmp_path / "nats")]
                server = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                wait_for_port("127.0.0.1", port, timeout_s=30)
                continue
            result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
            if expected:
                assert expected in result.stdout, f"{command}: expected {expected!r}, got\n{result.stdout}"
    finally:
        if server is not None:
            os.kill(server.pid, signal.SIGTERM)
            server.wait(timeout=15)

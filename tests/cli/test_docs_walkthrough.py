"""The README's quick start "Try the bus by hand", run line by line as written (only the port and the
server's store directory are moved to a free port and a temp dir), with the output each line's comment
quotes; and docs/bring-your-own.md, its files written and its commands run in a temp dir."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
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


BYO = ROOT / "docs" / "bring-your-own.md"


def byo_page() -> tuple[dict[str, str], list[tuple[str, str | None]]]:
    """The files docs/bring-your-own.md writes (each block whose first line is `# byo/<path>`), and the lines of
    its bash block with the output each line's comment quotes."""
    files, commands = {}, []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", BYO.read_text(), flags=re.S):
        first = body.partition("\n")[0]
        if first.startswith("# byo/"):
            files[first.removeprefix("# ")] = body
        elif lang == "bash":
            for line in body.splitlines():
                command, _, comment = line.partition("#")
                quoted = re.search(r'"([^"]+)"', comment)
                commands.append((command.strip(), quoted.group(1) if quoted else None))
    return files, commands


@pytest.mark.timeout(600)  # five processes start torch: ~30 s on an idle machine, minutes on a loaded one
def test_the_bring_your_own_page_runs_as_written(tmp_path):
    files, commands = byo_page()
    assert sorted(files) == ["byo/byo.yaml", "byo/make_dataset.py", "byo/make_model.py", "byo/rewards/sums.py"]
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "RELAX_"))}
    env["PYTHONPATH"] = str(ROOT)
    for command, expected in commands:
        if command.startswith("export "):
            for assignment in shlex.split(command.removeprefix("export ")):
                name, _, value = assignment.partition("=")
                env[name] = value.replace("$PWD", str(tmp_path))
            continue
        program, *args = shlex.split(command)
        argv = {"python": [sys.executable], "relax": [sys.executable, "-m", "workers.cli"]}[program] + args
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
        if expected:
            assert expected in result.stdout, f"{command}: expected {expected!r}, got\n{result.stdout}"
    assert (tmp_path / "hub" / "models--acme--tiny-chat" / "refs" / "main").is_file()
    steps = [json.loads(line) for line in (tmp_path / "runs" / "byo" / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "reward/score/mean" in s]
    assert [s["step"] for s in trained] == [1, 2, 3], steps
    # The reward takes `level` as a required argument: had the column not reached it, every call would fail.
    assert all(s["reward/error_rate"] == 0 for s in trained), trained

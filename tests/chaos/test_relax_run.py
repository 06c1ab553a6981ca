"""Chaos against the main command: SIGKILL the embedded nats-server of a real `relax run` twice, or its actor
six times, during training. The run finishes with exit 0, every released group is trained exactly once or
dropped with a reason, and no traceback reaches the terminal.

`relax run` prints the PIDs of what it started; the kills go to those PIDs. The accounting is read
afterwards from the run's own NATS store (runs/<run>/nats), served by a fresh server on another port."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.errors import NatsUnreachable
from relax_bus.settings import ConnectionSettings
from tests.e2e.cluster import Cluster, small_config
from tests.e2e.test_pipeline import run_id
from workers.config import PipelineConfig, parse_config
from workers.launch.embedded import serve_run_dir
from workers.launch.processes import RunProcesses

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


class RelaxRun:
    """`relax run CONFIG` as a subprocess, its output collected line by line."""

    def __init__(self, tmp_path: Path, **overrides: object) -> None:
        self.config = parse_config(small_config(run_id(), **overrides))
        self.path = tmp_path / "run.yaml"
        self.path.write_text(yaml.safe_dump(self.config.model_dump(mode="json", exclude={"chain"})))
        self.run_dir = tmp_path / "run"
        self._start()

    def again(self) -> RelaxRun:
        """The same `relax run CONFIG --run-dir DIR` started again, once this one has ended (a re-run resumes)."""
        assert self.proc.poll() is not None, "the first relax run is still running"
        twin = copy.copy(self)
        twin._start()
        return twin

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workers.cli", "run", str(self.path), "--run-dir", str(self.run_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def pid_of(self, label: str) -> int:
        """The PID `relax run` last reported for `label` ("NATS" or a role process such as "actor-0")."""
        pattern = r"NATS .*?pid (\d+)" if label == "NATS" else rf"\b{re.escape(label)} \(pid (\d+)\)"
        found = re.findall(pattern, self.output)
        assert found, f"no pid of {label} yet:\n{self.output}"
        return int(found[-1])

    def steps(self) -> int:
        metrics = self.run_dir / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    async def wait_steps(self, n: int, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while self.steps() < n:
            assert self.proc.poll() is None, f"relax run exited with {self.proc.returncode}:\n{self.output}"
            assert time.monotonic() < deadline, f"step {n} not reached in {timeout_s}s:\n{self.output}"
            await asyncio.sleep(0.2)

    async def wait_line(self, fragment: str, after: int, timeout_s: float = 60) -> None:
        """Wait for a line containing `fragment` among the lines after the first `after`."""
        deadline = time.monotonic() + timeout_s
        while not any(fragment in line for line in self.lines[after:]):
            assert self.proc.poll() is None, f"relax run exited with {self.proc.returncode}:\n{self.output}"
            assert time.monotonic() < deadline, f"no {fragment!r} within {timeout_s}s:\n{self.output}"
            await asyncio.sleep(0.1)

    def wait_exit(self, timeout_s: float = 300) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(10)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:  # a failure above: SIGTERM, so relax run stops what it started
            self.proc.terminate()
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    async def check_exactly_once(self, tmp_path: Path) -> None:
        """Serve the run's store again and check where every released group went."""
        config = self.config
        server, settings = serve_run_dir(self.run_dir)  # the run's account, served with its users again
        with server:
            nc = await connect(settings, name="after")
            bus = await Bus.attach(nc, config.run, PipelineConfig)
            unstarted = RunProcesses(config, server.url, tmp_path / "w", tmp_path / "l")
            record = Cluster(server.url, config, tmp_path, unstarted, bus)
            try:
                acc = await record.accounting()
                acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
                assert await record.kv_int("trainer.step") == config.trainer.steps
                reasons = [m.reason for m in await record.read("dlq")]  # type: ignore[attr-defined]
                assert all(reasons), f"a dead letter without a reason: {reasons}"
            finally:
                await nc.close()


async def test_two_sigkills_of_the_embedded_nats_server(tmp_path):
    run = RelaxRun(tmp_path, trainer={"steps": 40, "checkpoint": {"every": 4}, "warmup": {"max_steps": 0}})
    try:
        await run.wait_steps(1)
        await _each_role_is_its_own_user(run)
        for kill_at in (5, 15):
            await run.wait_steps(kill_at)
            before = len(run.lines)
            os.kill(run.pid_of("NATS"), signal.SIGKILL)
            await run.wait_line("NATS back", before)
        assert run.wait_exit() == 0, run.output
    finally:
        run.stop()
    out = run.output
    assert "Traceback" not in out and '"level"' not in out, out  # one line per outage, no log records
    assert len(re.findall(r"NATS .*exited with -9", out)) == 2, out
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["nats_restarts"] == 2, summary
    await run.check_exactly_once(tmp_path)


async def _each_role_is_its_own_user(run: RelaxRun) -> None:
    """Secure by default: the embedded server refuses anonymous clients, and each role process holds its
    own user's credentials and nobody else's."""
    url = re.search(r"NATS (nats://\S+)", run.output).group(1)  # type: ignore[union-attr]
    with pytest.raises(NatsUnreachable, match="uthorization"):
        await connect(ConnectionSettings(nats_url=[url], connect_timeout_s=2), name="anonymous")
    passwords = set()
    for role in ("feeder", "rollout", "reward", "actor"):
        environ = Path(f"/proc/{run.pid_of(f'{role}-0')}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
        assert env["RELAX_USER"] == f"{run.config.run}-{role}", env.get("RELAX_USER")
        passwords.add(env["RELAX_PASSWORD"])
    assert len(passwords) == 4, "every role has a password of its own"
    admin = (run.run_dir / "auth" / "admin.env").read_text()
    assert not any(p in admin for p in passwords)


async def test_six_sigkills_of_the_actor_with_requeue(tmp_path):
    run = RelaxRun(
        tmp_path,
        trainer={"steps": 16, "checkpoint": {"every": 1}, "warmup": {"max_steps": 0}},
        staleness={"max_staleness": 1, "action": "requeue"},
    )
    try:
        for kill in range(6):
            await run.wait_steps(2 + 2 * kill)  # each kill after the restarted actor has trained again
            before = len(run.lines)
            os.kill(run.pid_of("actor-0"), signal.SIGKILL)
            await run.wait_line("actor-0 (pid", before)  # restarted, with its new pid
        assert run.wait_exit() == 0, run.output
    finally:
        run.stop()
    out = run.output
    assert "Traceback" not in out, out
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["restarts"] == {"actor-0": 6}, summary
    assert "restarts: actor-0 6" in out, out
    await run.check_exactly_once(tmp_path)

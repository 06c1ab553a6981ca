"""The local cluster: the compose files validate, and `up` of the real image trains a run.

The validation needs Debian's `docker-compose` (1.29, offline `config`). The real run needs root and
Podman: `.ci/containers.sh` readies the host (Podman, podman-compose, local stand-ins for the official
base images, the CPU torch wheel in .wheelhouse/) and names the podman-compose command; the test then
builds the image once, `up -d`s the project under a unique name with NATS on free loopback ports,
follows the run from outside through the published port, and always ends with `down -v`.

Either tool missing skips the test on a developer machine and fails it where containers are required
(CI=true or RELAX_REQUIRE_CONTAINERS=1, as `.ci/run` sets).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.envelope import open_message
from relax_bus.settings import ConnectionSettings, load_run_config
from schemas import TrainGroup

pytestmark = pytest.mark.compose

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "docker-compose.yml"
CLUSTER = ROOT / "docker-compose.cluster.yml"
RUN = load_run_config(ROOT / "examples" / "compose.yaml").run
REQUIRE_CONTAINERS = os.environ.get("CI", "").lower() == "true" or os.environ.get("RELAX_REQUIRE_CONTAINERS") == "1"

MIN_STEPS = 3  # optimizer steps the run must show before the checks
BUILD_TIMEOUT_S = 1200  # a cold image build: torch, transformers, the project (~3-5 min here)
TRAIN_TIMEOUT_S = 600  # from `up -d` to MIN_STEPS trained: warm-up included (~1-2 min here)


def _missing(what: str) -> None:
    if REQUIRE_CONTAINERS:
        pytest.fail(f"{what}, and containers are required here (CI=true or RELAX_REQUIRE_CONTAINERS=1)")
    pytest.skip(what)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- (a) the files validate


@pytest.mark.parametrize("files", [[BASE], [BASE, CLUSTER]], ids=["single", "cluster"])
def test_compose_files_validate(files: list[Path]) -> None:
    tool = shutil.which("docker-compose")
    if tool is None:
        _missing("docker-compose is not installed (apt-get install docker-compose, or .ci/containers.sh)")
    args = [tool, "--project-directory", str(ROOT)]
    for f in files:
        args += ["-f", str(f)]
    result = subprocess.run([*args, "config"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    services = subprocess.run([*args, "config", "--services"], capture_output=True, text=True, timeout=60)
    names = set(services.stdout.split())
    assert {"nats", "init", "feeder", "rollout", "reward", "actor"} <= names, names
    if CLUSTER in files:
        assert {"nats-2", "nats-3"} <= names, names
        assert "replicas: 3" in (ROOT / "examples" / "compose-cluster.yaml").read_text()


# ---------------------------------------------------------------- (b) a real `up` trains


Say = Callable[[str], None]


@pytest.fixture
def say(capsys: pytest.CaptureFixture[str]) -> Say:
    """Progress of a minutes-long test, live on the terminal (past pytest's capture)."""

    def write(message: str) -> None:
        with capsys.disabled():
            print(f"\n[compose {time.strftime('%H:%M:%S')}] {message}", end="", flush=True)

    return write


@dataclass
class Project:
    """One podman-compose project of docker-compose.yml, under a unique name."""

    command: list[str]
    name: str
    env: dict[str, str]
    nats_port: int

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    def compose(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.command, "-p", self.name, "-f", str(BASE), *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def containers(self, service: str | None = None) -> list[str]:
        args = ["podman", "ps", "-a", "--format", "{{.Names}}"]
        args += ["--filter", f"label=io.podman.compose.project={self.name}"]
        if service:
            args += ["--filter", f"label=com.docker.compose.service={service}"]
        out = subprocess.run(args, capture_output=True, text=True, timeout=60).stdout
        return sorted(out.split())

    def logs(self, lines: int = 15) -> str:
        parts = []
        for name in self.containers():
            status = subprocess.run(
                ["podman", "inspect", "--format", "{{.State.Status}} (exit {{.State.ExitCode}})", name],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
            log = subprocess.run(
                ["podman", "logs", "--tail", str(lines), name], capture_output=True, text=True, timeout=30
            )
            parts.append(f"--- {name}: {status}\n{(log.stdout + log.stderr).strip()}")
        return "\n".join(parts)


@pytest.fixture
def project(say: Say) -> Iterator[Project]:
    """The prepared host's podman-compose, a unique project name, free loopback ports; `down -v` after."""
    if os.geteuid() != 0:
        _missing("the compose run needs root (rootful Podman)")
    if shutil.which("podman") is None and not REQUIRE_CONTAINERS:
        pytest.skip("podman is not installed (run .ci/containers.sh as root)")
    started = time.monotonic()
    prepared = subprocess.run(
        [str(ROOT / ".ci" / "containers.sh")], cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    if prepared.returncode != 0 or not prepared.stdout.strip():
        pytest.fail(f".ci/containers.sh failed (exit {prepared.returncode}):\n{prepared.stderr[-3000:]}")
    command = prepared.stdout.strip().splitlines()[-1].split()
    say(f"host prepared in {time.monotonic() - started:.0f}s; podman-compose: {' '.join(command)}")
    nats_port = _free_port()
    env = {
        **os.environ,
        "RELAX_NATS_PORT": str(nats_port),
        "RELAX_NATS_MONITOR_PORT": str(_free_port()),
        "TORCH_WHEELHOUSE": ".wheelhouse",
    }
    env.pop("RELAX_RUN", None)
    env.pop("RELAX_RUN_CONFIG", None)
    p = Project(command, f"relaxtest{uuid.uuid4().hex[:8]}", env, nats_port)
    try:
        yield p
    finally:
        down = p.compose("down", "-v", timeout=300)
        left = p.containers()
        for name in left:  # what `down` missed (a half-started project): this project's containers only
            subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True, timeout=60)
        say(f"down -v: exit {down.returncode}; {len(left)} container(s) left over and removed")


def _inspect(url: str) -> dict[str, Any] | None:
    """`relax inspect RUN --json` from outside, through the published port; None before init."""
    result = subprocess.run(
        [sys.executable, "-m", "relax_bus.cli", "inspect", RUN, "--json", "--nats-url", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(result.stdout) if result.returncode == 0 else None


async def _train_stream_rollout_workers(url: str) -> Counter[str]:
    """Rollout worker id of every group in the train stream (what reached the trainer)."""
    nc = await connect(ConnectionSettings(nats_url=[url]), name="compose-test")
    try:
        bus = await Bus.attach(nc, RUN)
        stream = bus.topology.stream("train").name
        state = (await bus.js.stream_info(stream)).state
        workers: Counter[str] = Counter()
        for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
            raw = await bus.js.get_msg(stream, seq)
            group = await open_message(raw.data or b"", raw.headers, bus.media, TrainGroup)
            assert isinstance(group, TrainGroup)
            workers[group.scored.rollout.worker_id] += 1
        return workers
    finally:
        await nc.close()


@pytest.mark.timeout(BUILD_TIMEOUT_S + TRAIN_TIMEOUT_S + 600)
def test_compose_up_trains_with_two_rollout_replicas(project: Project, say: Say) -> None:
    started = time.monotonic()
    build = project.compose("build", timeout=BUILD_TIMEOUT_S)
    assert build.returncode == 0, f"build failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"
    say(f"image built in {time.monotonic() - started:.0f}s")

    started = time.monotonic()
    up = project.compose("up", "-d", timeout=600)
    assert up.returncode == 0, f"up -d failed:\n{up.stderr[-3000:]}\n{project.logs()}"
    rollouts = project.containers("rollout")
    assert len(rollouts) == 2, f"expected 2 rollout replicas, found {rollouts}"
    say(f"up -d in {time.monotonic() - started:.0f}s: {' '.join(project.containers())}")

    deadline = started + TRAIN_TIMEOUT_S
    info: dict[str, Any] | None = None
    trained_by: Counter[str] = Counter()
    while time.monotonic() < deadline:
        info = _inspect(project.url)
        version = info["policy_version"] if info else None
        if version is not None and version >= MIN_STEPS:
            trained_by = asyncio.run(_train_stream_rollout_workers(project.url))
            if len(trained_by) >= 2:
                break
        live = sorted(w["role"] for w in info["workers"]) if info else []
        say(f"{time.monotonic() - started:4.0f}s  policy version {version}  live workers {live}")
        time.sleep(5)
    elapsed = time.monotonic() - started
    assert info is not None and info["policy_version"] >= MIN_STEPS, (
        f"no {MIN_STEPS} steps within {TRAIN_TIMEOUT_S}s (info: {info and info['policy_version']})\n{project.logs()}"
    )
    say(f"policy version {info['policy_version']} after {elapsed:.0f}s; train groups by worker {dict(trained_by)}")

    # Both rollout replicas generated groups the trainer consumed, and both are live workers that did work.
    assert len(trained_by) >= 2, f"train groups came from {dict(trained_by)} only\n{project.logs()}"
    beats = [w for w in info["workers"] if w["role"] == "rollout"]
    assert len({w["worker_id"] for w in beats}) == 2, beats
    assert all(w["counters"].get("processed", 0) > 0 for w in beats), beats
    # The actor checkpoints into the run's weights store (at step 0 and every trainer.checkpoint_every).
    assert "trainer.checkpoint" in info["state"], info["state"]
    weights = next(o for o in info["object_stores"] if o["key"] == "weights")
    assert weights.get("bytes", 0) > 0, weights

"""The local cluster: the compose files validate, and `up` of the real image trains a run.

The validation also reads the effective config of each combination (single server, cluster, auth):
NATS has a healthcheck on its monitoring port's /healthz, the roles wait for it to be healthy, and
each role is given longer to stop than a worker's drain takes.

The validation needs Debian's `docker-compose` (1.29, offline `config`). The real run needs root and
Podman: `.ci/containers.sh` readies the host (Podman, podman-compose, local stand-ins for the official
base images, the CPU torch wheel in .wheelhouse/) and names the podman-compose command; the test then
builds the image once, `up -d`s the project under a unique name with NATS on free loopback ports,
follows the run from outside through the published port, and always ends with `down -v`.

Either tool missing skips the test on a developer machine and fails it where containers are required
(CI=true or RELAX_REQUIRE_CONTAINERS=1, as `.ci/run` sets); tests/container_host.py holds that rule and the
host preparation, which the containers tier shares. Every nats service runs NATS_IMAGE, the image of the
nats-server version pinned in pyproject.toml (the one the bus tests run).
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
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from nats.aio.client import DEFAULT_DRAIN_TIMEOUT

from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.delivery import WorkerOptions
from relax_bus.envelope import open_message
from relax_bus.settings import ConnectionSettings
from schemas import TrainGroup
from tests.container_host import NATS_IMAGE, missing, prepare_host
from tests.workers.test_metrics_sinks import sample_of, tensorboard_series
from workers.config import PipelineConfig, load_config
from workers.role_registry import ROLE_NAMES, ROLES

pytestmark = pytest.mark.compose

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "docker-compose.yml"
CLUSTER = ROOT / "docker-compose.cluster.yml"
AUTH = ROOT / "docker-compose.auth.yml"
GPU = ROOT / "docker-compose.gpu.yml"
RUN = load_config(ROOT / "examples" / "compose.yaml").run

MIN_STEPS = 3  # optimizer steps the run must show before the checks
PROFILE = "prometheus"  # the monitoring profile's Prometheus (its Grafana has no image on this host)
IMAGE_LABEL = "org.relax-bus.image=relax-bus"  # the Dockerfile's LABEL, on every stage
BUILD_TIMEOUT_S = 1200  # a cold image build: torch, transformers, the project (~3-5 min here)
TRAIN_TIMEOUT_S = 600  # from `up -d` to MIN_STEPS trained: warm-up included (~1-2 min here)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- (a) the files validate


def _seconds(duration: str) -> float:
    """A compose duration of whole units (`75s`, `1m30s`) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    total, number = 0.0, ""
    for ch in duration:
        if ch.isdigit() or ch == ".":
            number += ch
        else:
            total, number = total + float(number) * units[ch], ""
    assert not number, f"duration {duration!r} has no unit"
    return total


def _check_health_and_shutdown(services: dict[str, Any]) -> None:
    """NATS reports its health, the roles wait for it, and stopping a role outlasts its drain."""
    test = services["nats"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and "127.0.0.1/8222" in test[1], test
    assert "/healthz?js-enabled-only=true" in test[1], test
    # Every role is stopped only after in-flight handlers had their grace and the connection drained.
    drain_s = WorkerOptions().grace_s + DEFAULT_DRAIN_TIMEOUT
    roles = [name for name in ROLE_NAMES if name in services]
    assert {"feeder", "rollout", "reward", "actor"} <= set(roles), roles
    for name in roles:
        service = services[name]
        assert service["depends_on"]["nats"]["condition"] == "service_healthy", (name, service["depends_on"])
        assert service["depends_on"]["init"]["condition"] == "service_completed_successfully", name
        assert _seconds(service["stop_grace_period"]) > drain_s, (name, service["stop_grace_period"], drain_s)


def _check_gpus(services: dict[str, Any]) -> None:
    """The GPU override: every relax service runs the CUDA image (built once, by init, with VARIANT=cuda), and each
    role the registry gives GPUs reserves NVIDIA devices of its own (compose does not share them out)."""
    assert services["init"]["build"]["args"]["VARIANT"] == "cuda", services["init"]["build"]
    relax = [name for name in (*ROLE_NAMES, "init") if name in services]
    assert {services[name]["image"] for name in relax} == {"relax-bus:cuda"}, {n: services[n]["image"] for n in relax}
    taken: list[str] = []
    for entry in ROLES:
        devices = services[entry.name].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        if not entry.deploy.gpus:
            assert devices is None, (entry.name, devices)
            continue
        (device,) = devices
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], (entry.name, device)
        assert len(device["device_ids"]) == entry.deploy.gpus, (entry.name, device)
        assert services[entry.name]["deploy"]["replicas"] == 1, entry.name  # replicas would share the devices
        taken += device["device_ids"]
    assert len(taken) == len(set(taken)) >= 2, f"GPU roles share devices by default: {taken}"


@pytest.mark.parametrize(
    "files", [[BASE], [BASE, CLUSTER], [BASE, AUTH], [BASE, GPU]], ids=["single", "cluster", "auth", "gpu"]
)
def test_compose_files_validate(files: list[Path]) -> None:
    tool = shutil.which("docker-compose")
    if tool is None:
        missing("docker-compose is not installed (apt-get install docker-compose, or .ci/containers.sh)")
    args = [tool, "--project-directory", str(ROOT)]
    for f in files:
        args += ["-f", str(f)]
    # cwd: docker-compose 1.29 reads the reward service's seccomp profile relative to it (Compose v2: to the project)
    result = subprocess.run([*args, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    services = subprocess.run([*args, "config", "--services"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    names = set(services.stdout.split())
    assert {"nats", "init", "feeder", "rollout", "reward", "actor"} <= names, names
    config = yaml.safe_load(result.stdout)["services"]
    images = {name: s.get("image") for name, s in config.items()}
    nats_images = {name: image for name, image in images.items() if name.startswith("nats") and name != "nats-box"}
    assert nats_images and set(nats_images.values()) == {NATS_IMAGE}, nats_images
    if CLUSTER in files:
        assert {"nats-2", "nats-3"} <= names, names
        assert "replicas: 3" in (ROOT / "examples" / "compose-cluster.yaml").read_text()
    _check_health_and_shutdown(config)
    if GPU in files:
        _check_gpus(config)
    else:
        assert not any("nvidia" in json.dumps(s) for s in config.values()), "GPUs in the CPU default"
    # The healthcheck asks the monitoring port: the server must serve it (in auth mode on its loopback).
    if AUTH in files:
        assert "--monitor-port 8222" in " ".join(config["auth"]["command"]), config["auth"]["command"]
    else:
        command = config["nats"]["command"]
        assert "-m" in command and command[command.index("-m") + 1] == "8222", command


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
    metrics_port: int
    prometheus_port: int

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    def compose(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.command, "-p", self.name, "-f", str(BASE), "--profile", PROFILE, *args],
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
    started = time.monotonic()
    command = prepare_host()
    say(f"host prepared in {time.monotonic() - started:.0f}s; podman-compose: {' '.join(command)}")
    nats_port, metrics_port, prometheus_port = _free_port(), _free_port(), _free_port()
    env = {
        **os.environ,
        "RELAX_NATS_PORT": str(nats_port),
        "RELAX_NATS_MONITOR_PORT": str(_free_port()),
        "RELAX_METRICS_PORT": str(metrics_port),
        "RELAX_PROMETHEUS_PORT": str(prometheus_port),
        "TORCH_WHEELHOUSE": ".wheelhouse",
    }
    env.pop("RELAX_RUN", None)
    env.pop("RELAX_RUN_CONFIG", None)
    p = Project(command, f"relaxtest{uuid.uuid4().hex[:8]}", env, nats_port, metrics_port, prometheus_port)
    stamp = int(time.time())  # images older than this are another test run's
    try:
        yield p
    finally:
        down = p.compose("down", "-v", timeout=300)
        left = p.containers()
        for name in left:  # what `down` missed (a half-started project): this project's containers only
            subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True, timeout=60)
        say(f"down -v: exit {down.returncode}; {len(left)} container(s) left over and removed")
        # Each build untags the previous relax-bus image (~1.6 GB, and its ~1.8 GB build stage): remove the
        # untagged ones older than this test, keeping this build's stages as the next build's cache.
        prune = subprocess.run(
            ["podman", "image", "prune", "-f", "--filter", f"label={IMAGE_LABEL}", "--filter", f"until={stamp}"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        say(f"image prune: exit {prune.returncode}; {len(prune.stdout.split())} untagged image(s) removed")


def _inspect(url: str) -> dict[str, Any] | None:
    """`relax inspect RUN --json` from outside, through the published port; None before init."""
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "inspect", RUN, "--json", "--nats-url", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(result.stdout) if result.returncode == 0 else None


async def _train_stream_rollout_workers(url: str) -> Counter[str]:
    """Rollout worker id of every group in the train stream (what reached the trainer)."""
    nc = await connect(ConnectionSettings(nats_url=[url]), name="compose-test")
    try:
        bus = await Bus.attach(nc, RUN, PipelineConfig)
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


def _prometheus(port: int, api: str, **params: object) -> list[dict[str, Any]] | None:
    """The `result` of a query of the compose project's Prometheus; None while it is not listening."""
    query = urllib.parse.urlencode({"query": f'relax_step{{run="{RUN}"}}', **params})
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/{api}?{query}", timeout=10) as reply:
            return list(json.load(reply)["data"]["result"])
    except (urllib.error.URLError, ConnectionError):
        return None


def _prometheus_steps(port: int, since: float) -> list[float]:
    """Every relax_step value Prometheus stored since `since` (epoch seconds), in time order."""
    result = _prometheus(port, "query_range", start=since, end=time.time(), step=1)
    return [float(v) for _, v in result[0]["values"]] if result else []


def _metrics_files(project: Project) -> Path:
    """The metrics service's file sinks: `<work-dir>/<run>/metrics` in the project's work volume."""
    volume = f"{project.name}_relax-work"
    args = ["podman", "volume", "inspect", volume, "--format", "{{.Mountpoint}}"]
    mount = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert mount.returncode == 0, mount.stderr
    return Path(mount.stdout.strip()) / ".relax" / "work" / RUN / "metrics"


def _check_metrics(project: Project, since: float, say: Say) -> None:
    """Prometheus scraped the metrics service and holds the step moving; TensorBoard and W&B files are written.

    The run may be over by now (40 steps take seconds here once warm): what Prometheus stored since `up`
    shows the movement, and a still-running step is seen as it goes."""
    deadline = time.monotonic() + 180
    seen: list[float] = []
    while time.monotonic() < deadline and len(set(seen)) < 2:
        seen = _prometheus_steps(project.prometheus_port, since)
        time.sleep(2)  # Prometheus scrapes every 2 s (deploy/monitoring/prometheus.yml)
    assert len(set(seen)) >= 2 and seen == sorted(seen), f"Prometheus relax_step: {seen}\n{project.logs()}"
    direct = sample_of(f"http://127.0.0.1:{project.metrics_port}/metrics", "relax_step", RUN)
    assert direct is not None and direct >= seen[-1], (direct, seen[-1])
    first, moved = seen[0], seen[-1]
    files = _metrics_files(project)
    series = tensorboard_series(files / "tensorboard", "reward_mean")
    assert [s for s, _ in series] == list(range(1, len(series) + 1)) and len(series) >= MIN_STEPS, series
    assert list((files / "wandb").glob("offline-run-*")), sorted(p.name for p in (files / "wandb").iterdir())
    assert int((files / "wandb" / "relax-last-step").read_text()) >= MIN_STEPS
    say(f"Prometheus saw relax_step {first:.0f} -> {moved:.0f}; TensorBoard holds steps 1-{len(series)}")


def _busy_rollouts(info: dict[str, Any]) -> int:
    """Live rollout workers whose heartbeat reports at least one processed group."""
    return sum(1 for w in info["workers"] if w["role"] == "rollout" and w["counters"].get("processed", 0) > 0)


@pytest.mark.timeout(BUILD_TIMEOUT_S + TRAIN_TIMEOUT_S + 600)
def test_compose_up_trains_with_two_rollout_replicas(project: Project, say: Say) -> None:
    started = time.monotonic()
    build = project.compose("build", timeout=BUILD_TIMEOUT_S)
    assert build.returncode == 0, f"build failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"
    say(f"image built in {time.monotonic() - started:.0f}s")

    started, up_at = time.monotonic(), time.time()
    up = project.compose("up", "-d", timeout=600)
    assert up.returncode == 0, f"up -d failed:\n{up.stderr[-3000:]}\n{project.logs()}"
    rollouts = project.containers("rollout")
    assert len(rollouts) == 2, f"expected 2 rollout replicas, found {rollouts}"
    say(f"up -d in {time.monotonic() - started:.0f}s: {' '.join(project.containers())}")

    # Wait for the state the checks read: MIN_STEPS trained, groups of both replicas in the train stream,
    # and both replicas' heartbeats (rewritten every heartbeat_ttl_s / 3) reporting processed groups.
    deadline = started + TRAIN_TIMEOUT_S
    info: dict[str, Any] | None = None
    trained_by: Counter[str] = Counter()
    while time.monotonic() < deadline:
        info = _inspect(project.url)
        version = info["policy_version"] if info else None
        if version is not None and version >= MIN_STEPS:
            trained_by = asyncio.run(_train_stream_rollout_workers(project.url))
            if len(trained_by) >= 2 and _busy_rollouts(info) >= 2:
                break
        live = sorted(w["role"] for w in info["workers"]) if info else []
        say(f"{time.monotonic() - started:4.0f}s  policy version {version}  live workers {live}")
        time.sleep(2)  # poll interval; nothing is asserted until the awaited state is seen or the deadline passes
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
    # The actor checkpoints into the run's weights store (at step 0 and every trainer.checkpoint.every).
    assert "trainer.checkpoint" in info["state"], info["state"]
    weights = next(o for o in info["object_stores"] if o["key"] == "weights")
    assert weights.get("bytes", 0) > 0, weights
    _check_metrics(project, up_at, say)

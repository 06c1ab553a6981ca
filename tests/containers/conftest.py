"""The containers tier's backend: the bus fixtures, served by a nats-server container instead of a binary.

One `NatsContainer(image=NATS_IMAGE, jetstream=True)` per test module, started by testcontainers over
Podman's Docker-compatible API, with its ports published on 127.0.0.1 only. Only `nats_server` is
overridden: the root conftest's `settings`, `make_bus` and `bus` then connect to the container, and helpers
that take a server (`tests.bus.test_crash.start_worker`) read its `url` as they read the binary's. Every
test provisions its own uuid-named run, so tests sharing the container never see each other's streams.

The host is readied by `.ci/containers.sh` (tests/container_host.py): no root, Podman or image skips the
tier on a developer machine and fails it where containers are required (CI=true or
RELAX_REQUIRE_CONTAINERS=1, as `.ci/run` sets).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests import container_host
from tests.container_host import NATS_IMAGE


@dataclass(frozen=True)
class NatsContainerServer:
    """A started nats-server container, as the bus fixtures see a server: by its client URL."""

    url: str
    image: str
    container_id: str


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsContainerServer]:
    """A nats-server container with JetStream on a free loopback port; removed after the module."""
    container_host.prepare_host()
    with pytest.MonkeyPatch.context() as env:
        docker_env = container_host.docker_api_env()
        for key, value in docker_env.items():
            env.setenv(key, value)
        # Imported only now: testcontainers reads part of its configuration (the connection mode) at import.
        from docker.errors import DockerException
        from testcontainers.community.nats import NatsContainer
        from testcontainers.core.exceptions import ContainerStartException

        container: NatsContainer | None = None
        try:
            container = NatsContainer(image=NATS_IMAGE, jetstream=True)  # connects to the API at once
            for exposed in list(container.ports):
                container.ports[exposed] = ("127.0.0.1",)  # docker-py: loopback only, any free host port
            container.start()
            port = container.get_exposed_port(container.client_port)
        except (DockerException, ContainerStartException, TimeoutError, ConnectionError) as err:
            if container is not None:
                container.stop()
            container_host.missing(f"{NATS_IMAGE} did not start over {docker_env['DOCKER_HOST']}: {err!r}")
        try:
            yield NatsContainerServer(f"nats://127.0.0.1:{port}", NATS_IMAGE, container.get_container_id())
        finally:
            container.stop()

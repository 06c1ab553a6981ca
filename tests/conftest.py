"""Shared fixtures: a real nats-server per test (never a mock) and uuid-named runs.

A missing nats-server binary skips bus tests on a developer machine, and fails them when the
environment says the server is required (CI=true or RELAX_REQUIRE_NATS=1, as `.ci/run` sets).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import nats.errors
import pytest

from relax_bus import log
from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.errors import NatsServerNotFound
from relax_bus.ops.server import EmbeddedServer
from relax_bus.provision import delete_run, provision
from relax_bus.settings import ConnectionSettings
from tests.nats_cluster import NatsCluster
from workers.config import PipelineConfig, parse_config

log.configure("info", json=False)

REQUIRE_NATS = os.environ.get("CI", "").lower() == "true" or os.environ.get("RELAX_REQUIRE_NATS") == "1"
TIERS = (
    "unit",
    "bus",
    "cli",
    "workers",
    "deploy",
    "e2e",
    "chaos",
    "compose",
    "containers",
)  # a test without one is `unit`


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(m) for m in TIERS):
            item.add_marker(pytest.mark.unit)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the accounting tables of the chaos runs, when any ran."""
    from tests.chaos.report import REPORTS, SOAK_TABLES, render

    if REPORTS:
        terminalreporter.section("chaos accounting")
        for line in render(REPORTS):
            terminalreporter.write_line(line)
    for table in SOAK_TABLES:
        terminalreporter.section("soak")
        for line in table:
            terminalreporter.write_line(line)


@pytest.fixture
def nats_server(tmp_path: Any) -> Iterator[EmbeddedServer]:
    """A fresh nats-server with JetStream on a free loopback port and a temp store dir."""
    try:
        server = EmbeddedServer(store_dir=tmp_path / "nats")
    except NatsServerNotFound as err:
        if REQUIRE_NATS:
            pytest.fail(f"nats-server is required here but missing: {err}")
        pytest.skip(str(err))
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def nats_cluster(tmp_path: Any) -> Iterator[NatsCluster]:
    """Three nats-servers forming one JetStream cluster on loopback ports, each with its own store."""
    try:
        cluster = NatsCluster(tmp_path / "nats-cluster")
    except NatsServerNotFound as err:
        if REQUIRE_NATS:
            pytest.fail(f"nats-server is required here but missing: {err}")
        pytest.skip(str(err))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture
def settings(nats_server: EmbeddedServer) -> ConnectionSettings:
    return ConnectionSettings(nats_url=[nats_server.url])


def run_config(**overrides: Any) -> PipelineConfig:
    """A small run config with a unique run id; nested sections merge over the defaults."""
    data: dict[str, Any] = {
        "run": f"t{uuid.uuid4().hex[:10]}",
        "groups_per_step": 2,
        "samples_per_group": 2,
        "bus": {"ack_wait_s": 5, "max_deliver": 3, "duplicate_window_s": 120, "heartbeat_ttl_s": 2},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return parse_config(data)


MakeBus = Callable[..., Awaitable[Bus]]


@pytest.fixture
async def make_bus(settings: ConnectionSettings) -> AsyncIterator[MakeBus]:
    """Factory: provision a run (config overrides as kwargs) and return a Bus attached to it.

    The runs are deleted afterwards: a server shared by several tests (the containers tier's) would
    otherwise keep every test's stream reservations and run out of JetStream storage."""
    opened: list[tuple[Bus, PipelineConfig]] = []

    async def make(config: PipelineConfig | None = None, **overrides: Any) -> Bus:
        config = config or run_config(**overrides)
        nc = await connect(settings, name="test")
        await provision(nc.jetstream(), config)
        bus = await Bus.attach(nc, config.run, PipelineConfig)
        opened.append((bus, config))
        return bus

    yield make
    for bus, config in opened:
        if bus.nc.is_connected:
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                await delete_run(bus.js, config)
        await bus.nc.close()


@pytest.fixture
async def bus(make_bus: MakeBus) -> Bus:
    return await make_bus()

"""Shared fixtures: a real nats-server per test (never a mock) and uuid-named runs.

A missing nats-server binary skips bus tests on a developer machine, and fails them when the
environment says the server is required (CI=true or RELAX_REQUIRE_NATS=1, as `.ci/run` sets).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from relax_bus import log
from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.errors import NatsServerNotFound
from relax_bus.provision import provision
from relax_bus.server import EmbeddedServer
from relax_bus.settings import ConnectionSettings, RunConfig, parse_run_config
from tests.nats_cluster import NatsCluster

log.configure("info", json=False)

REQUIRE_NATS = os.environ.get("CI", "").lower() == "true" or os.environ.get("RELAX_REQUIRE_NATS") == "1"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(m) for m in ("unit", "bus", "cli", "workers", "e2e", "chaos", "compose")):
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


def run_config(**overrides: Any) -> RunConfig:
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
    return parse_run_config(data)


MakeBus = Callable[..., Awaitable[Bus]]


@pytest.fixture
async def make_bus(settings: ConnectionSettings) -> AsyncIterator[MakeBus]:
    """Factory: provision a run (config overrides as kwargs) and return a Bus attached to it."""
    opened: list[Bus] = []

    async def make(config: RunConfig | None = None, **overrides: Any) -> Bus:
        config = config or run_config(**overrides)
        nc = await connect(settings, name="test")
        await provision(nc.jetstream(), config)
        bus = await Bus.attach(nc, config.run)
        opened.append(bus)
        return bus

    yield make
    for bus in opened:
        await bus.nc.close()


@pytest.fixture
async def bus(make_bus: MakeBus) -> Bus:
    return await make_bus()

"""A whole run with every role a process under its own least-privilege NATS user (`relax auth`)."""

from __future__ import annotations

import uuid

import pytest

from relax_bus.ops.credentials import write_bundle
from relax_bus.settings import ConnectionSettings
from tests.bus.test_auth import server_from
from tests.e2e.cluster import Cluster, small_config
from workers.config import parse_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


async def test_a_run_under_per_role_credentials_trains_every_group_once(tmp_path):
    config = parse_config(small_config(f"auth{uuid.uuid4().hex[:8]}", trainer={"steps": 4}))
    bundle = write_bundle(config, tmp_path / "auth", store_dir=None)
    server = server_from(bundle, tmp_path / "nats")
    try:
        admin = ConnectionSettings(_env_file=bundle.env_files["admin"], nats_url=[server.url])  # type: ignore[call-arg]
        role_env = {role: cred.env(server.url) for role, cred in bundle.credentials.items()}
        cluster = await Cluster.start(server.url, config, tmp_path, settings=admin, role_env=role_env)
        try:
            await cluster.wait_done()
            acc = await cluster.accounting()
            acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
            for role in cluster.roles:
                log = role.log_path.read_text(errors="replace").lower()
                assert "permissions violation" not in log, cluster.log_tail(role)
        finally:
            await cluster.stop()
    finally:
        server.cleanup()

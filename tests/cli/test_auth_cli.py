"""`relax auth` as a user runs it: files written once, a server started from them, init and inspect as
the admin and the observer."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from relax_bus.errors import NatsServerNotFound
from relax_bus.ops.server import find_nats_server, free_port, wait_for_port
from tests.cli.test_cli import assert_one_line_error, relax, write_config
from tests.conftest import REQUIRE_NATS

pytestmark = pytest.mark.cli


def env_file(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def test_auth_writes_private_files_once_and_the_server_enforces_them(tmp_path):
    try:
        binary = find_nats_server()
    except NatsServerNotFound as err:
        if REQUIRE_NATS:
            pytest.fail(str(err))
        pytest.skip(str(err))
    cfg = write_config(tmp_path, "run: clauth\n")
    out, port = tmp_path / "auth", free_port()
    args = ("auth", cfg, "--out", str(out), "--port", str(port), "--store-dir", str(tmp_path / "js"))
    first = relax(*args)
    assert first.returncode == 0, first.stderr
    assert "run clauth: 7 NATS users written" in first.stdout and "bcrypt" in first.stdout
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(
        [
            "nats-server.conf",
            "auth.conf",
            *(f"{r}.env" for r in ("feeder", "rollout", "reward", "actor", "metrics", "admin", "observer")),
        ]
    )
    assert all((out / f).stat().st_mode & 0o777 == 0o600 for f in files)
    rollout = env_file(out / "rollout.env")
    assert rollout["RELAX_USER"] == "clauth-rollout" and rollout["RELAX_INBOX_PREFIX"] == "_INBOX.clauth-rollout"
    assert rollout["RELAX_PASSWORD"] not in (out / "auth.conf").read_text()  # only its bcrypt hash is there

    assert_one_line_error(relax(*args), "already holds", "--force")
    assert relax(*args, "--force").returncode == 0
    assert env_file(out / "rollout.env")["RELAX_PASSWORD"] != rollout["RELAX_PASSWORD"]

    proc = subprocess.Popen(
        [str(binary), "-c", str(out / "nats-server.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for_port("127.0.0.1", port, 10, proc)
        url = f"nats://127.0.0.1:{port}"
        assert_one_line_error(relax("init", cfg, "--nats-url", url), "Authorization Violation")
        init = relax("init", cfg, "--nats-url", url, env=env_file(out / "admin.env"))
        assert init.returncode == 0 and "19 created" in init.stdout, init.stderr
        shown = relax("inspect", "clauth", "--nats-url", url, "--json", env=env_file(out / "observer.env"))
        assert shown.returncode == 0 and '"run": "clauth"' in shown.stdout, shown.stderr
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)


def test_auth_takes_the_run_id_as_an_override_as_init_does(tmp_path):
    """The Kubernetes run.yaml has no `run:` (its run id is the kustomization's): `relax auth FILE run=ID`."""
    config = write_config(tmp_path, "groups_per_step: 2\nsamples_per_group: 2\n")
    assert_one_line_error(relax("auth", config, "--out", str(tmp_path / "none")), "run: Field required")
    out = tmp_path / "auth"
    result = relax("auth", config, "run=k8s_run", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert env_file(out / "rollout.env")["RELAX_USER"] == "k8s_run-rollout"
    assert "RELAX_k8s_run" in (out / "auth.conf").read_text()

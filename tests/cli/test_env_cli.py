"""`relax env serve` and the env role as a user runs them: subprocesses, a real server, readable errors."""

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest

from relax_bus.connection import connect
from relax_bus.settings import ConnectionSettings
from tests.cli.test_cli import ROOT, assert_one_line_error, relax, write_config
from tests.counter_env import expected
from workers.envs.base import EnvItem
from workers.envs.client import EnvClient

pytestmark = pytest.mark.cli


def test_the_env_role_of_a_run_without_an_agent_section_is_refused(nats_server, tmp_path):
    cfg = write_config(tmp_path, "run: noenv\n")
    assert relax("init", cfg, "--nats-url", nats_server.url).returncode == 0
    result = relax("worker", "env", "--run", "noenv", "--nats-url", nats_server.url)
    assert_one_line_error(result, "run noenv has no env role (the run has no agent section)")


def test_serve_refuses_an_unknown_class_and_bad_options(nats_server):
    result = relax("env", "serve", "tests.nope:Env", "--run", "r", "--nats-url", nats_server.url)
    assert_one_line_error(result, "cannot import tests.nope")
    result = relax("env", "serve", "tests.counter_env:Counter", "--run", "r", "--options", "[1]")
    assert_one_line_error(result, "a JSON object")


def test_serve_answers_episodes_and_inspect_lists_it(nats_server, tmp_path):
    cfg = write_config(tmp_path, "run: agentic\nagent: {env: {type: 'tests.counter_env:Counter'}}\n")
    assert relax("init", cfg, "--nats-url", nats_server.url).returncode == 0
    command = [sys.executable, "-m", "workers.cli", "env", "serve", "tests.counter_env:Counter", "--run", "agentic"]
    proc = subprocess.Popen(
        [*command, "--nats-url", nats_server.url, "--options", '{"start": 7}'],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once it answers
        assert "serving tests.counter_env:Counter for run agentic as instance" in line, (line, proc.stderr)
        instance = line.split("as instance ")[1].split()[0]

        async def one_episode() -> str:
            nc = await connect(ConnectionSettings(nats_url=[nats_server.url]))
            try:
                session = await EnvClient(nc, "agentic").open(EnvItem(episode="g/0/0", prompt="p"))
                assert session.instance == instance and session.observation == "start p at 7"
                return (await session.step("abc")).observation
            finally:
                await nc.close()

        assert asyncio.run(one_episode()) == expected(["abc"], start=7)[0]
        shown = relax("inspect", "agentic", "--nats-url", nats_server.url)
        assert shown.returncode == 0, shown.stderr
        assert "environment servers (1)" in shown.stdout
        cells = next(line for line in shown.stdout.splitlines() if line.strip().startswith(instance)).split()
        assert cells[1] == "tests.counter_env:Counter" and cells[3:6] == ["1", "1", "0"], cells  # resets steps errors
        data = json.loads(relax("inspect", "agentic", "--nats-url", nats_server.url, "--json").stdout)
        assert [i["instance"] for i in data["environments"]] == [instance]
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

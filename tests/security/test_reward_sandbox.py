"""User reward code runs sandboxed: a hostile function gets a reward error, the worker lives on, and the
sandbox keeps no credentials, no network, no lasting processes and only bounded resources.

The functions are in tests/security/reward_attacks.py. A fork bomb is only ever run with a process
limit of 8 that is known to apply (the sandbox runs as a uid other than root).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.waiting import until
from workers.rewards.sandbox.client import Sandbox
from workers.rewards.sandbox.process import OUTPUT_TAIL_BYTES
from workers.rewards.scorer import Scorer

pytestmark = pytest.mark.workers

ATTACKS = "tests.security.reward_attacks"
ROOT = Path(__file__).resolve().parents[2]


def scorer(function: str, timeout_s: float = 5.0, options: dict | None = None, **sandbox: object) -> Scorer:
    options = {"function": f"{ATTACKS}:{function}", **(options or {})}
    return Scorer([{"type": "python", "timeout_s": timeout_s, "options": options, "sandbox": sandbox}])


def only_sandbox(scorer: Scorer) -> Sandbox:
    (sandbox,) = scorer._sandboxes.values()
    return sandbox


def _stat(pid: int) -> tuple[str, int] | None:
    """State and process group of a live process; None once it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else (fields[0], int(fields[2]))


def in_group(pgid: int) -> list[int]:
    return sorted(pid for pid in _pids() if (stat := _stat(pid)) is not None and stat[1] == pgid)


def named(marker: str) -> list[int]:
    """Live processes whose argv[0] starts with `marker`."""
    found = []
    for pid in _pids():
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if argv0.startswith(marker) and _stat(pid) is not None:
            found.append(pid)
    return sorted(found)


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique name for the grandchildren a test's function starts; any still alive are killed after."""
    name = f"relax-test-{uuid.uuid4().hex[:8]}"
    yield name
    for pid in named(name):
        os.kill(pid, signal.SIGKILL)


async def test_a_fork_bomb_is_contained_and_the_next_call_works():
    with scorer("fork_bomb", timeout_s=2.0, processes=8) as bombed:
        sandbox = only_sandbox(bombed)
        assert sandbox.info["uid"] != 0 and sandbox.info["limits"]["RLIMIT_NPROC"] == 8, sandbox.info
        group = sandbox.pid
        scoring = asyncio.create_task(asyncio.to_thread(bombed.score, "bomb", None, "stop"))
        largest = 0
        while not scoring.done():  # sample the group's size until the call returns
            largest = max(largest, len(in_group(group)))
            await asyncio.sleep(0.05)
        result = await scoring
        assert result == (0.0, {}, "timed out after 2s")
        assert 3 <= largest <= 9, largest  # it forked, up to 8 processes of the sandbox uid (+ the supervisor)
        await until(lambda: in_group(group), lambda left: left == [], 10, "the bomb's processes gone")
        assert bombed.score("fine", None, "stop") == (1.0, {"fork_bomb": 1.0}, None)


def test_a_memory_hog_gets_a_memory_error_and_the_sandbox_answers_again():
    with scorer("memory_hog", memory_mb=512) as hogged:
        reward, components, error = hogged.score("hog", None, "stop")
        assert (reward, components) == (0.0, {}) and error.startswith("MemoryError"), error
        assert hogged.score("fine", None, "stop") == (1.0, {"memory_hog": 1.0}, None)


async def test_printing_100_mb_neither_blocks_nor_floods_the_worker():
    with scorer("chatty") as chatty:
        assert chatty.score("print", None, "stop") == (1.0, {"chatty": 1.0}, None)
        sandbox = only_sandbox(chatty)
        tail = await until(sandbox.output_tail, lambda t: t.endswith("END-OF-OUTPUT\n"), 10, "the output's tail")
        assert len(tail) <= OUTPUT_TAIL_BYTES and set(tail[:-14]) == {"x"}


def test_returning_100_mb_is_a_reward_error():
    with scorer("huge") as huge:
        assert huge.score("string", None, "stop").error == (
            "TypeError: reward function returned str, expected a float or a dict of floats"
        )
        error = huge.score("key", None, "stop").error
        assert error.startswith("RewardReplyTooLarge: the reply is 2000") and "1048576 allowed" in error, error
        assert huge.score("fine", None, "stop") == (1.0, {"huge": 1.0}, None)


def test_the_sandbox_sees_no_credentials(monkeypatch):
    secrets = {
        "RELAX_PASSWORD": "s3cret",
        "RELAX_USER": "alice",
        "RELAX_NATS_URL": "nats://alice:s3cret@127.0.0.1:4222",
        "RELAX_CREDS_FILE": "/etc/relax/s3cret.creds",
        "NATS_TOKEN": "s3cret",
        "SOME_API_TOKEN": "t0ken",
        "HF_HOME": "/models/hf",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    options = {"worker_pid": os.getpid()}
    with scorer("environment", options=options, pass_env=["HF_HOME"]) as probe:
        score = probe.score("", None, "stop")
    assert score.error is None
    assert score.components == {
        "environment.relax": 0.0,
        "environment.nats": 0.0,
        "environment.password": 0.0,
        "environment.token": 0.0,
        "environment.passed_on": 1.0,
        "environment.private_home": 1.0,
        "environment.worker_environ": 0.0,
    }


def test_credentials_cannot_be_passed_on():
    for name in ("RELAX_PASSWORD", "relax_user", "MY_NATS_URL"):
        with pytest.raises(ValueError, match=f"{name} may hold the bus credentials"):
            scorer("environment", pass_env=[name])


async def test_a_hung_function_and_the_grandchildren_it_started_are_killed(marker):
    with scorer("spawns_and_hangs", timeout_s=2.0, options={"marker": marker}) as spawner:
        assert "pid" in only_sandbox(spawner).info["namespaces"], "no PID namespace: a new session would escape"
        scoring = asyncio.create_task(asyncio.to_thread(spawner.score, "hang", None, "stop"))
        grandchildren = await until(lambda: named(marker), lambda found: len(found) == 2, 10, "both grandchildren")
        assert await scoring == (0.0, {}, "timed out after 2s")
        await until(lambda: [p for p in grandchildren if _stat(p)], lambda left: left == [], 10, "grandchildren gone")


async def test_closing_the_scorer_kills_what_the_function_left_running(marker):
    with scorer("spawns_and_hangs", options={"marker": marker}) as spawner:
        assert "pid" in only_sandbox(spawner).info["namespaces"], "no PID namespace: a new session would escape"
        assert spawner.score("leave", None, "stop").reward == 1.0
        grandchildren = await until(lambda: named(marker), lambda found: len(found) == 2, 10, "both grandchildren")
    await until(lambda: [p for p in grandchildren if _stat(p)], lambda left: left == [], 10, "grandchildren gone")


async def test_a_worker_killed_outright_takes_its_sandbox_with_it(marker):
    script = (
        "import sys; from relax_bus.log import configure; from workers.rewards.scorer import Scorer\n"
        "configure('warning')\n"
        f"options = {{'function': '{ATTACKS}:spawns_and_hangs', 'marker': '{marker}'}}\n"
        "s = Scorer([{'type': 'python', 'options': options}])\n"
        "(sandbox,) = s._sandboxes.values()\n"
        "print(s.score('leave', None, 'stop').reward, sandbox._process.home.name, *sandbox.info['namespaces'])\n"
        "sys.stdout.flush()\n"
        "sys.stdin.read()\n"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        reward, home, *namespaces = (await asyncio.to_thread(worker.stdout.readline)).split()
        assert reward == "1.0" and "pid" in namespaces and os.path.isdir(home), (reward, home, namespaces)
        grandchildren = await until(lambda: named(marker), lambda found: len(found) == 2, 10, "both grandchildren")
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        worker.stdin.close()
        worker.stdout.close()
    await until(lambda: [p for p in grandchildren if _stat(p)], lambda left: left == [], 10, "grandchildren gone")
    await until(lambda: os.path.exists(home), lambda there: not there, 10, "the sandbox's HOME removed")


def test_replies_that_are_not_json_too_large_or_mistyped_are_errors():
    with scorer("forges_replies") as forger:
        for attack, problem in [
            ("junk", "a reply that is not JSON"),
            ("long", "a reply of more than 1048576 bytes"),
            ("wrong_type", "a value that is not a float or a dict of floats"),
        ]:
            assert forger.score(attack, None, "stop") == (
                0.0,
                {},
                f"RewardProtocolError: the reward process sent {problem}",
            ), attack
            assert forger.score("fine", None, "stop") == (1.0, {"forges_replies": 1.0}, None), attack


def test_the_network_is_cut_off_unless_allowed():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        options = {"port": listener.getsockname()[1]}
        with scorer("connects", options=options) as isolated:
            assert "net" in only_sandbox(isolated).info["namespaces"], only_sandbox(isolated).info
            assert isolated.score("", None, "stop") == (0.0, {"connects": 0.0}, None)
        with scorer("connects", options=options, isolate_network=False) as connected:
            assert connected.score("", None, "stop") == (1.0, {"connects": 1.0}, None)


def test_file_size_and_open_files_are_limited():
    with scorer("writes_file", options={"megabytes": 2}, file_size_mb=1) as writer:
        assert writer.score("", None, "stop").error == "OSError: [Errno 27] File too large"
    with scorer("writes_file", options={"megabytes": 2}, file_size_mb=4) as writer:
        assert writer.score("", None, "stop").error is None
    with scorer("opens_files", options={"count": 100}, open_files=32) as opener:
        assert opener.score("", None, "stop").error == "OSError: [Errno 24] Too many open files: '/dev/null'"
        assert opener.score("", None, "stop").error.startswith("OSError: [Errno 24]")


def test_cpu_is_limited_and_a_busy_sandbox_is_replaced_before_it_runs_out():
    with scorer("burns_cpu", timeout_s=60.0, options={"cpu_s": 100.0}, cpu_s=2) as burner:
        assert burner.score("burn", None, "stop").error == "RewardProcessDied: the reward process was killed by SIGXCPU"
    with scorer("burns_cpu", timeout_s=60.0, options={"cpu_s": 1.2}, cpu_s=2) as burner:
        sandbox = only_sandbox(burner)
        first = sandbox.pid
        assert burner.score("burn", None, "stop").reward == 1.0
        assert sandbox.pid is None  # it used more than half its 2 s: retired after answering
        assert burner.score("", None, "stop").reward == 1.0 and sandbox.pid not in (None, first)

"""User reward code runs sandboxed: a hostile function gets a reward error, the worker lives on, and the
sandbox keeps no credentials, no network, no lasting processes and only bounded resources.

The functions are in tests/security/reward_attacks.py. A fork bomb is only ever run with a process
limit of 8 that is known to apply (the sandbox runs as a uid other than root).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.waiting import until
from workers.rewards.sandbox import confine
from workers.rewards.sandbox.client import Sandbox
from workers.rewards.sandbox.process import OUTPUT_TAIL_BYTES
from workers.rewards.scorer import Scorer
from workers.roles.serve import SANDBOX_HIDES

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


def test_one_memory_limit_holds_for_the_whole_sandbox_tree():
    """Finding 4: the limit was per process; 6 children x 40 MiB under memory_mb 128 now end the sandbox."""
    options = {"children": 6, "megabytes": 40}
    with scorer("memory_tree", timeout_s=30.0, options=options, memory_mb=128) as forker:
        reward, components, error = forker.score("fork", None, "stop")
        assert (reward, components) == (0.0, {}) and error == (
            "RewardOutOfMemory: the sandbox's processes together held more than memory_mb (128)"
        ), error
        assert forker.score("", None, "stop") == (1.0, {"memory_tree": 1.0}, None)


# ---------------------------------------------------------------- the attack, as root and as nobody, with
# namespaces and with `unshare` refused: isolated, or refused in one line (finding 4, Build item 2)

WORKER = """
import json, os, socket, sys
from relax_bus.log import configure
from workers.roles.serve import hidden_by_launcher, make_undumpable
from workers.rewards.sandbox.process import hide
from workers.rewards.scorer import Scorer
configure("warning")
make_undumpable()  # what every role does at start
hide(*hidden_by_launcher())  # and what `relax run` asks of it: no sandbox sees the run dir
scratch, sandbox = sys.argv[1], json.loads(sys.argv[2])
sys.path.append(os.path.join(scratch, "modules"))
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
options = {
    "function": "tests.security.reward_attacks:escape",
    "worker_pid": os.getpid(),
    "secret_file": os.path.join(scratch, "auth", "admin.env"),
    "module": os.path.join(scratch, "modules", "victim.py"),
    "port": listener.getsockname()[1],
}
try:
    scorer = Scorer([{"type": "python", "options": options, "sandbox": sandbox}])
except ValueError as err:
    print(json.dumps({"refused": str(err)}))
    sys.exit(0)
with scorer:
    (info,) = [s.info for s in scorer._sandboxes.values()]
    score = scorer.score("", None, "stop")
print(json.dumps({"components": score.components, "error": score.error, "info": info}))
"""

NOBODY = 65534
ISOLATED = {
    "escape.environ": 0.0,
    "escape.memory": 0.0,
    "escape.credentials_file": 0.0,
    "escape.network": 0.0,
    "escape.import_path": 0.0,
    "escape.working_directory": 0.0,
    "escape.scratch_writable": 1.0,
}


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A worker's files, owned by nobody (a non-root worker reads its own 0600 files): an auth directory
    with admin.env (0600), a module directory on its import path, and its working directory."""
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="relax-attack-"))  # not under pytest's 0700 tmp: nobody must reach it
    top.chmod(0o755)
    (top / "auth").mkdir(mode=0o700)
    (top / "auth" / "admin.env").write_text("RELAX_PASSWORD=s3cret\n")
    (top / "auth" / "admin.env").chmod(0o600)
    (top / "modules").mkdir()
    (top / "modules" / "victim.py").write_text("PLANTED = False\n")
    (top / "work").mkdir()
    for path in [top, *top.rglob("*")]:
        os.chown(path, NOBODY, NOBODY)
    yield top
    shutil.rmtree(top)


_SECCOMP = {"x86_64": (0xC000003E, 272), "aarch64": (0xC00000B7, 97)}
"""The audit arch and unshare's syscall number, per machine."""


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def refuse_unshare() -> None:
    """Install a seccomp filter that answers unshare(2) with EPERM, as the container runtimes' default
    profiles do for a process without CAP_SYS_ADMIN (the shipped compose and Kubernetes reward pods)."""
    arch, unshare = _SECCOMP[platform.machine()]
    program = (_SockFilter * 6)(
        _SockFilter(0x20, 0, 0, 4),  # A = seccomp_data.arch
        _SockFilter(0x15, 0, 3, arch),  # another arch: allow
        _SockFilter(0x20, 0, 0, 0),  # A = seccomp_data.nr
        _SockFilter(0x15, 0, 1, unshare),
        _SockFilter(0x06, 0, 0, 0x00050000 | errno.EPERM),  # SECCOMP_RET_ERRNO
        _SockFilter(0x06, 0, 0, 0x7FFF0000),  # SECCOMP_RET_ALLOW
    )
    fprog = _SockFprog(len(program), program)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0):  # NO_NEW_PRIVS, SECCOMP
        raise OSError(ctypes.get_errno(), "seccomp filter refused")


def reachable_interpreter() -> None:
    """As root, in a mount namespace of this process only: when the interpreter lives under /root (0700, as
    pyenv installs it), put a tmpfs of mode 0755 over /root holding just that installation, so a process
    without capabilities can run it."""
    base = os.path.realpath(sys.base_prefix)
    if not base.startswith("/root/"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    ok = libc.unshare(0x00020000) == 0 and libc.mount(None, b"/", None, 1 << 14 | 1 << 18, None) == 0
    keep = os.open(base, os.O_PATH)  # in the new namespace: a bind's source must be of it
    ok = ok and libc.mount(b"tmpfs", b"/root", b"tmpfs", 0, b"mode=0755") == 0
    os.makedirs(base, exist_ok=True)
    ok = ok and libc.mount(f"/proc/self/fd/{keep}".encode(), base.encode(), None, 4096 | 1 << 14, None) == 0
    os.close(keep)
    if not ok:
        raise OSError(ctypes.get_errno(), "cannot show the interpreter to nobody")


def attack(
    scratch: Path,
    *,
    nobody: bool,
    refuse_unshare_: bool,
    sandbox: object = None,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """Run WORKER (a reward worker holding RELAX_PASSWORD) as root or as nobody, with unshare(2) refused by
    a seccomp filter or not; its JSON line.

    nobody has no capability at all; where the interpreter lives under a 0700 /root, it is shown to it in a
    mount namespace of the worker's own (`reachable_interpreter`)."""
    if os.geteuid() != 0 or platform.machine() not in _SECCOMP:
        pytest.fail(f"these tests run as root on x86_64 or aarch64 (as CI does), not uid {os.geteuid()}")

    def confine_worker() -> None:
        if nobody:
            reachable_interpreter()
            confine.drop_privileges(NOBODY, NOBODY, keep_read_all=False)
        if refuse_unshare_:
            refuse_unshare()

    base = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "RELAX_PASSWORD": "s3cret", "HOME": str(scratch)}
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(scratch), json.dumps(sandbox or {})],
        cwd=cwd or scratch / "work",
        env={**base, **(env or {})},
        preexec_fn=confine_worker,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["log"] = done.stdout + done.stderr
    return result


@pytest.mark.parametrize("nobody", [False, True], ids=["root", "nobody"])
def test_with_namespaces_the_attack_reaches_nothing(scratch, nobody):
    """The escape function, as a reward: the worker's environ and memory, a 0600 credentials file of its
    uid, the bus's port, a module on its import path and its working directory are out of reach."""
    found = attack(scratch, nobody=nobody, refuse_unshare_=False)
    assert "components" in found, found
    assert found["components"] == ISOLATED, found
    assert found["info"]["view_refused"] is None and {"pid", "net"} <= set(found["info"]["namespaces"]), found
    assert (scratch / "modules" / "victim.py").read_text() == "PLANTED = False\n"
    assert not (scratch / "work" / "planted.txt").exists()


def test_a_run_dir_under_the_working_directory_is_masked_as_relax_run_asks(scratch):
    """`relax run`'s default run dir (runs/<run>, with every user's credentials in auth/) lies under the roles'
    working directory, which the sandbox's view shows read-only; the launcher names it in RELAX_SANDBOX_HIDES
    and every sandbox masks it."""
    found = attack(scratch, nobody=True, refuse_unshare_=False, cwd=scratch, env={SANDBOX_HIDES: str(scratch / "auth")})
    assert "components" in found, found
    assert found["components"]["escape.credentials_file"] == 0.0, found


@pytest.mark.parametrize("nobody", [False, True], ids=["root", "nobody"])
def test_with_unshare_refused_code_executing_rewards_are_refused_in_one_line(scratch, nobody):
    found = attack(scratch, nobody=nobody, refuse_unshare_=True)
    assert "refused" in found, found
    line = found["refused"]
    assert "\n" not in line and line.startswith("the reward sandbox cannot isolate user code"), line
    assert "namespaces refused" in line and "sandbox: unisolated" in line, line
    assert "Traceback" not in found["log"], found["log"]
    assert (scratch / "modules" / "victim.py").read_text() == "PLANTED = False\n"


@pytest.mark.parametrize("nobody", [False, True], ids=["root", "nobody"])
def test_unisolated_by_choice_warns_once_and_the_worker_stays_undumpable(scratch, nobody):
    """`sandbox: unisolated` runs the code without namespaces: it then has the worker's uid, network and
    files (said in the warning), but the worker's environ and memory stay unreadable (non-dumpable)."""
    found = attack(scratch, nobody=nobody, refuse_unshare_=True, sandbox="unisolated")
    assert "components" in found, found
    assert found["components"]["escape.environ"] == 0.0 and found["components"]["escape.memory"] == 0.0, found
    assert found["log"].count("reward_sandbox_not_isolated") == 1, found["log"]

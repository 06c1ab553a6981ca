"""One started reward sandbox process: how it is spawned, the worker's ends of its pipes, how it is killed.

`SandboxProcess.spawn` starts `python -m workers.rewards.sandbox.child` with a scrubbed environment, the
worker's working directory and import path, a session of its own and four pipes (requests, replies, a
lifeline, and stdout/stderr, drained by a thread that keeps only the tail). `kill` closes the lifeline
(the child's supervisor then kills its server, and with it the server's PID namespace), waits for the
supervisor to exit, kills what is left of the process group, and reaps it. `Sandbox`
(`workers.rewards.sandbox.client`) speaks the protocol over these pipes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

from workers.config.rewards import RewardSandbox

MAX_REPLY_BYTES = 1 << 20
"""A reply line longer than this is refused (a reward error) and the sandbox is replaced."""
OUTPUT_TAIL_BYTES = 4096
"""How much of what user code printed is kept, for the log line of a sandbox that died or timed out."""
STOP_WAIT_S = 5.0
"""How long a stopped sandbox's supervisor may take to kill its server before its group is killed."""
_LOCALE = ("LANG", "LC_ALL", "LC_CTYPE")
_ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
"""Set to 1 unless passed on: a BLAS starting a thread per core would run into the process limit."""


_HIDDEN: set[str] = set()
"""Paths the sandbox's view masks even where they lie on the import path or under the working directory."""


def hide(*paths: str | os.PathLike[str]) -> None:
    """Mask `paths` (directories or files) in every sandbox started from now on: the role's work directory
    and its credentials files' directories (`workers.roles.serve` names them at start)."""
    for path in paths:
        _HIDDEN.update({os.path.abspath(path), os.path.realpath(path)})


class LineTooLong(Exception):
    """Raised by `LineReader.line` when a line grows past its limit."""


class SandboxProcess:
    """One started sandbox: its supervisor process, the worker's ends of its pipes, its private HOME."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        requests: int,
        replies: int,
        lifeline: int,
        output: int,
        home: tempfile.TemporaryDirectory[str],
    ) -> None:
        self.popen = popen
        self.requests = requests
        self.replies = LineReader(replies, MAX_REPLY_BYTES)
        self.output = _OutputTail(output, OUTPUT_TAIL_BYTES)
        self.home = home
        self.sent = 0
        """Requests sent so far: each carries the next id, and its reply must carry it back."""
        self._release = weakref.finalize(self, _close_fds, lifeline, requests, replies)
        """Closes the lifeline (the supervisor then kills the server) when killed, collected or at exit."""

    @classmethod
    def spawn(cls, settings: RewardSandbox, code_dirs: tuple[str, ...] = ()) -> SandboxProcess:
        """Start the child with `settings`' limits; it confines itself, then says so on the reply pipe.
        `code_dirs` (the directories of reward files named by path) join its import path and its view."""
        home = tempfile.TemporaryDirectory(prefix="relax-reward-", ignore_cleanup_errors=True)
        user = settings.user if os.geteuid() == 0 else None
        if user is not None:  # the child switches to this uid: its HOME must be its own
            os.chown(home.name, user, settings.group)
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        lifeline_r, lifeline_w = os.pipe()
        output_r, output_w = os.pipe()
        path = [*_import_path(), *(d for d in code_dirs if d not in _import_path())]
        child = {
            "requests": requests_r,
            "replies": replies_w,
            "lifeline": lifeline_r,
            "user": settings.user,
            "group": settings.group,
            "isolate_network": settings.isolate_network,
            "memory_bytes": None if settings.memory_mb is None else settings.memory_mb << 20,
            "cpu_s": settings.cpu_s,
            "processes": settings.processes,
            "open_files": settings.open_files,
            "file_bytes": settings.file_size_mb << 20,
            "paths": [*path, os.getcwd()],
            "max_reply_bytes": MAX_REPLY_BYTES,
            "home": home.name,
            "hidden": sorted(_HIDDEN),
            "scratch_bytes": settings.scratch_mb << 20,
        }
        try:
            popen = subprocess.Popen(
                [sys.executable, "-m", "workers.rewards.sandbox.child", json.dumps(child)],
                stdin=subprocess.DEVNULL,
                stdout=output_w,
                stderr=output_w,
                pass_fds=(requests_r, replies_w, lifeline_r),
                env=_environment(settings, home.name, path),
                start_new_session=True,
            )
        except OSError:
            _close_fds(requests_w, replies_r, lifeline_w, output_r)
            home.cleanup()
            raise
        finally:
            _close_fds(requests_r, replies_w, lifeline_r, output_w)
        os.set_blocking(requests_w, False)
        return cls(popen, requests_w, replies_r, lifeline_w, output_r, home)

    def write(self, data: bytes, deadline: float) -> None:
        """Write all of `data` to the request pipe by `deadline` (TimeoutError, BrokenPipeError)."""
        poller = select.poll()
        poller.register(self.requests, select.POLLOUT)
        view = memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if poller.poll(remaining * 1000):
                try:
                    view = view[os.write(self.requests, view) :]
                except BlockingIOError:
                    continue

    def kill(self) -> int | None:
        """Kill the server and everything it started, reap the supervisor; its exit code."""
        self._release()  # the lifeline closes: the supervisor kills the server (and its PID namespace)
        pid = self.popen.pid
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:  # wait for it to exit, unreaped: its PID still holds the group
            try:
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    break
            except ChildProcessError:
                break
            time.sleep(0.005)
        try:
            os.killpg(pid, signal.SIGKILL)  # whatever is left of the group (no PID namespace, a stuck supervisor)
        except (ProcessLookupError, PermissionError):
            pass
        code = self.popen.wait()
        self.home.cleanup()  # mostly done already, by the supervisor
        return code


class LineReader:
    """Reads newline-terminated lines from a pipe with a deadline, refusing lines longer than `limit`."""

    def __init__(self, fd: int, limit: int) -> None:
        self.fd = fd
        self._limit = limit
        self._buffer = bytearray()
        os.set_blocking(fd, False)

    def line(self, deadline: float) -> bytes:
        """The next line without its newline; TimeoutError, EOFError (the writer closed) or LineTooLong."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while True:
            end = self._buffer.find(b"\n")
            if end > self._limit or (end < 0 and len(self._buffer) > self._limit):
                raise LineTooLong
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return line
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if not poller.poll(remaining * 1000):
                continue
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                raise EOFError
            self._buffer += chunk


class _OutputTail:
    """Drains the sandbox's stdout/stderr in a thread, so a chatty function never blocks; keeps the tail."""

    def __init__(self, fd: int, limit: int) -> None:
        self._fd = fd
        self._limit = limit
        self._tail = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._drain, name="reward-sandbox-output", daemon=True).start()

    def text(self) -> str:
        with self._lock:
            return self._tail.decode(errors="replace")

    def _drain(self) -> None:
        try:
            while chunk := os.read(self._fd, 1 << 16):
                with self._lock:
                    self._tail += chunk
                    del self._tail[: -self._limit]
        finally:
            os.close(self._fd)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:  # deliberate: already closed
            pass


def _import_path() -> list[str]:
    """The worker's import path, absolute (`''` is the working directory), existing entries once each."""
    entries: list[str] = []
    for entry in sys.path:
        path = os.path.abspath(entry or os.getcwd())
        if path not in entries and os.path.exists(path):
            entries.append(path)
    return entries


def _environment(settings: RewardSandbox, home: str, path: list[str]) -> dict[str, str]:
    """The sandbox's whole environment: nothing of the worker's but PATH, the locale and `pass_env`."""
    env = {name: os.environ[name] for name in ("PATH", *_LOCALE, *settings.pass_env) if name in os.environ}
    env.setdefault("PATH", os.defpath)
    for name in _ONE_THREAD:
        env.setdefault(name, "1")
    env |= {
        "HOME": home,
        "TMPDIR": home,
        "PYTHONPATH": os.pathsep.join(path),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
    }
    return env

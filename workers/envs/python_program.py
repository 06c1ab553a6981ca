"""Runs one Python program for the `python` environment, inside the reward sandbox's confined child.

`run_program` is the function the sandbox imports and calls (`Sandbox.call_json`); it never runs in the
environment's own process. Each program runs in a process forked for it, so that nothing it does to the
interpreter (a patched builtin, a replaced `sys.stdout`, an `os._exit`) reaches the sandbox's server or the
next program, and so that it can be killed at its deadline without losing the sandbox. The fork closes every
inherited descriptor but its result pipe (the sandbox's request and reply pipes among them), captures
`sys.stdout` in memory up to `max_output_chars`, compiles and executes the program as `__main__`, and writes
one JSON result on the pipe:

    {"output": <what it printed, cut>, "cut": bool, "error": <the error's last line> | None,
     "valid": <False when it does not compile>, "timed_out": bool}

Standard library only: it is imported after the sandbox confined itself, and should import fast.
"""

from __future__ import annotations

import io
import json
import os
import resource
import select
import signal
import sys
import time
import traceback
from typing import Any

MAX_ERROR_CHARS = 1000
"""An error line longer than this is cut (a program may raise with a huge message)."""
RESULT_SLACK_BYTES = 1 << 16
"""What a result may hold besides its output (the error line, the JSON around them)."""


def run_program(
    completion: str, answer: str | None, finish_reason: str, timeout_s: float = 5.0, max_output_chars: int = 2000
) -> dict[str, Any]:
    """Run `completion` as a Python program in a forked process for at most `timeout_s` seconds; its result
    (above). The signature is a sandbox function's: `answer` and `finish_reason` are not used."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the program's process: it never returns into the sandbox's server
        try:
            os.close(read_end)
            _run_child(completion, write_end, max_output_chars)
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        os.setpgid(pid, pid)  # also done by the child: whichever runs first
    except OSError:  # deliberate: it has already done it, or already exited
        pass
    deadline = time.monotonic() + timeout_s
    limit = max_output_chars * 6 + RESULT_SLACK_BYTES  # JSON escapes a character in 6 bytes at most
    try:
        data, complete = _read_until(read_end, deadline, limit)
    finally:
        os.close(read_end)
    status = _wait(pid, deadline if complete else time.monotonic())
    _reap_orphans()
    if len(data) > limit:
        return _result("", f"the program wrote more than {limit} bytes on its result pipe")
    if not complete:
        return _result("", f"TimeoutError: the program ran longer than {timeout_s:g}s", timed_out=True)
    return _parsed(data, 0 if status is None else status)  # None: it wrote its result, then would not exit


def _parsed(data: bytes, status: int) -> dict[str, Any]:
    try:
        result = json.loads(data)
    except ValueError:  # it ended before writing its result (os._exit, a signal), or wrote over it
        return _result("", f"the program {_how_it_ended(status)} before it finished")
    return result if isinstance(result, dict) else _result("", "the program sent no result")


def _run_child(code: str, result_fd: int, max_output_chars: int) -> None:
    os.setpgid(0, 0)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = soft if soft != resource.RLIM_INFINITY else 4096
    os.closerange(3, result_fd)
    os.closerange(result_fd + 1, top)
    me = os.getpid()
    output = _CappedText(max_output_chars)
    sys.stdout = output
    sys.stdin = io.StringIO()
    error: str | None = None
    valid = True
    try:
        program = compile(code, "<program>", "exec")
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as err:
        error, valid = _last_line(err), False
    else:
        try:
            exec(program, {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as exit_:
            if exit_.code not in (None, 0):
                error = f"SystemExit: {exit_.code}"
        except BaseException as err:  # deliberate: whatever the program raised is its result
            error = _last_line(err)
    if os.getpid() != me:  # a process the program forked, come back here: only the program answers
        os._exit(0)
    result = _result(output.text(), error, cut=output.cut, valid=valid)
    data = json.dumps(result, ensure_ascii=False).encode()
    view = memoryview(data)
    while view:
        view = view[os.write(result_fd, view) :]


class _CappedText(io.TextIOBase):
    """A writable text stream that keeps the first `limit` characters and counts the rest."""

    def __init__(self, limit: int) -> None:
        self._parts: list[str] = []
        self._kept = 0
        self._limit = limit
        self.cut = False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        room = self._limit - self._kept
        if len(text) > room:
            self.cut = True
        if room > 0:
            self._parts.append(text[:room])
            self._kept += min(room, len(text))
        return len(text)

    def text(self) -> str:
        return "".join(self._parts)


def _last_line(err: BaseException) -> str:
    try:
        return traceback.format_exception_only(type(err), err)[-1].strip()
    except Exception:  # deliberate: an exception whose __str__ raises still has a name
        return type(err).__name__


def _result(
    output: str, error: str | None, *, cut: bool = False, valid: bool = True, timed_out: bool = False
) -> dict[str, Any]:
    output = output.encode(errors="replace").decode()  # no lone surrogates past this point
    error = None if error is None else error[:MAX_ERROR_CHARS].encode(errors="replace").decode()
    return {"output": output, "cut": cut, "error": error, "valid": valid, "timed_out": timed_out}


def _read_until(fd: int, deadline: float, limit: int) -> tuple[bytes, bool]:
    """The bytes written until the writer closes, and True; what came by `deadline` (or before more than
    `limit` came) and False otherwise."""
    data = bytearray()
    while (remaining := deadline - time.monotonic()) > 0 and len(data) <= limit:
        if not select.select([fd], [], [], remaining)[0]:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return bytes(data), True
        data += chunk
    return bytes(data), False


def _wait(pid: int, deadline: float) -> int | None:
    """The child's wait status once it exits by `deadline`; None when it had to be killed (with its group)."""
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.002)
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except OSError:  # deliberate: already gone
            pass
    os.waitpid(pid, 0)
    return None


def _reap_orphans() -> None:
    """Reap what the program's own children left behind: in the sandbox's PID namespace they become this
    server's children when their parent ends."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _how_it_ended(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"

"""The sandbox user reward code runs in: one persistent child process, confined, spoken to in JSON lines.

The worker starts `python -m workers.rewards.sandbox.child` (the child's side, and the protocol) through
`workers.rewards.sandbox.process` (spawning, pipes, killing) with:

- a scrubbed environment: PATH, the locale, `sandbox.pass_env`, and the sandbox's own HOME and TMPDIR (a
  private temporary directory) and PYTHONPATH (the worker's import path, so user modules import as they
  do in the worker). Nothing named RELAX_* or containing NATS, hence no bus credentials;
- the worker's working directory, so that user code opening relative paths keeps working;
- a session and process group of its own, user (when not root), PID, network and mount namespaces, and
  in the mount namespace a private read-only view of the filesystem (`workers.rewards.sandbox.view`);
  where any of these is refused the sandbox does not start (`SandboxNotIsolated`, one line, at the
  role's pre-start check) unless the reward's config says `sandbox: unisolated`;
- rlimits (address space, CPU, processes, files, file size), one resident-memory limit for all its
  processes together (`workers.rewards.sandbox.memory`) and, when the worker is root, a lesser uid;
- three pipes of its own, requests, replies and a lifeline, and its stdout/stderr on a fourth that a
  thread drains, keeping the last `OUTPUT_TAIL_BYTES` for the log lines of a sandbox that died or hung.

Every reply is read with a deadline and a size cap, and checked: too large, not JSON, the wrong id or
not a float / dict of floats is a reward error, never a crash or a hang, and the child is replaced
(`call_json`, which runs a tool for an environment, takes any JSON value and leaves its check to the caller). A
timeout or a dead child tears down the whole sandbox; the next call starts a fresh one. No pickle: the
worker never deserialises anything but JSON from user code.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from relax_bus.log import get_logger
from workers.config.rewards import RewardSandbox
from workers.rewards.sandbox.memory import EXIT_OUT_OF_MEMORY
from workers.rewards.sandbox.process import MAX_REPLY_BYTES, LineTooLong, SandboxProcess
from workers.rewards.values import RewardValue, checked, checked_batch, code_dir, describe

log = get_logger(__name__)

START_TIMEOUT_S = 60.0
"""How long the sandbox may take to start and to import each user function."""
_V = TypeVar("_V")


class RewardFailed(Exception):
    """Raised by `Sandbox.call` when the function failed, timed out or the sandbox broke; the message is
    the error recorded with the zero reward."""


class SandboxNotIsolated(ValueError):
    """Raised by `Sandbox.start` when this machine refuses the sandbox its isolation and the reward's config
    does not say `sandbox: unisolated`."""


class Sandbox:
    """A persistent confined child that imports and runs user reward functions, one call at a time."""

    def __init__(
        self,
        functions: Sequence[tuple[str, dict[str, Any]]],
        settings: RewardSandbox,
        *,
        owner: str = "reward",
        batched: Collection[str] = (),
    ) -> None:
        self._functions = list(functions)
        """`(module:callable, options)` of every function, loaded and checked on each start."""
        self._batched = frozenset(batched)
        """The functions of `functions` called once per group with lists (`call_batch`)."""
        self._settings = settings
        self._owner = owner
        """What the config section that holds the `sandbox` settings is, for the refusal's line."""
        self._process: SandboxProcess | None = None
        self._lock = threading.Lock()
        self._warned = False
        self.info: dict[str, Any] = {}
        """What the last child reported about its confinement (uid, namespaces, limits)."""

    @property
    def pid(self) -> int | None:
        """PID of the running sandbox (its supervisor, the process group's leader), or None."""
        return None if self._process is None else self._process.popen.pid

    def output_tail(self) -> str:
        """The last bytes the running sandbox printed (stdout and stderr), decoded."""
        return "" if self._process is None else self._process.output.text()

    def start(self) -> None:
        """Start the child and import every function; ValueError names the first that cannot be imported,
        SandboxNotIsolated says what isolation this machine refuses."""
        with self._lock:
            try:
                self._start()
            except RewardFailed as err:
                raise ValueError(str(err)) from None

    def call(
        self,
        ref: str,
        completion: str,
        answer: str | None,
        finish_reason: str,
        options: dict[str, Any],
        timeout_s: float,
        prompt: str | None = None,
        columns: Mapping[str, Any] | None = None,
    ) -> RewardValue:
        """Run one function (given `prompt` and the item's `columns` when it declares them); RewardFailed on its
        error, on a timeout or if the sandbox broke."""
        request: dict[str, Any] = {"op": "call", "ref": ref, "completion": completion, "answer": answer}
        request |= {
            "finish_reason": finish_reason,
            "options": options,
            "prompt": prompt,
            "columns": dict(columns or {}),
        }
        return self._call(request, timeout_s, self._value)

    def call_batch(
        self,
        ref: str,
        completions: Sequence[str],
        prompts: Sequence[str],
        answers: Sequence[str | None],
        finish_reasons: Sequence[str],
        columns: Mapping[str, Sequence[Any]],
        options: dict[str, Any],
        timeout_s: float,
    ) -> list[float]:
        """Run one batched function on a group's samples, `fn(completions, prompts, answers, **columns)`: one
        float per completion; RewardFailed as for `call` (and for a value that is not that list)."""
        request: dict[str, Any] = {"op": "batch", "ref": ref, "completions": list(completions)}
        request |= {"prompts": list(prompts), "answers": list(answers), "finish_reasons": list(finish_reasons)}
        request |= {"columns": {k: list(v) for k, v in columns.items()}, "options": options}
        count = len(completions)
        return self._call(request, timeout_s, lambda reply: self._batch_value(reply, count))

    def call_json(self, ref: str, text: str, options: dict[str, Any], timeout_s: float) -> Any:
        """Run one function on `text` (as its completion, with no answer) that returns any JSON value, such
        as a tool's result, unchecked; RewardFailed as for `call`."""
        request: dict[str, Any] = {"op": "call", "ref": ref, "completion": text, "answer": None}
        request |= {"finish_reason": "stop", "options": options, "returns": "json"}
        return self._call(request, timeout_s, self._json_value)

    def _call(self, request: dict[str, Any], timeout_s: float, value_of: Callable[[dict[str, Any]], _V]) -> _V:
        with self._lock:
            if self._process is None:
                self._start()
            if not self._warned:
                self._warned = True
                self._warn_of_gaps(self.info)
            reply = self._request(request, timeout_s)
            if reply["status"] == "ok":
                value = value_of(reply)
            if reply.get("retire"):
                log.debug("reward_sandbox_recycled", pid=self.pid, cpu_s=self._settings.cpu_s)
                self._stop()
        if reply["status"] != "ok":
            raise RewardFailed(reply["error"])
        return value

    def stop(self) -> None:
        """Kill the sandbox and every process in it; the next call starts a fresh one."""
        with self._lock:
            self._stop()

    def _start(self) -> None:
        code_dirs = tuple(sorted({d for ref, _ in self._functions if (d := code_dir(ref)) is not None}))
        process = SandboxProcess.spawn(self._settings, code_dirs)
        self._process = process
        try:
            hello = self._receive({"op": "start"}, START_TIMEOUT_S, time.monotonic() + START_TIMEOUT_S)
        except RewardFailed as err:  # its output's tail is in the log line
            raise RewardFailed(f"the reward sandbox could not start: {err}") from None
        if hello.get("op") != "ready":
            self._stop()
            raise RewardFailed(f"the reward sandbox could not start: {hello.get('error')}")
        self.info = hello
        log.debug("reward_sandbox_started", pid=self.pid, uid=hello["uid"], namespaces=hello["namespaces"])
        if (missing := isolation_missing(hello)) and self._settings.isolation != "unisolated":
            self._stop()
            functions = ", ".join(sorted({ref for ref, _ in self._functions}))
            raise SandboxNotIsolated(
                f"the {self._owner} sandbox cannot isolate user code ({functions}) here: {missing}; allow "
                f"unprivileged user namespaces (docs/sandbox.md), or set `sandbox: unisolated` on the {self._owner} "
                "to run it anyway"
            )
        for ref, options in self._functions:
            try:
                load = {"op": "load", "ref": ref, "options": options, "batched": ref in self._batched}
                reply = self._request(load, START_TIMEOUT_S)
            except RewardFailed as err:
                reply = {"status": "error", "error": str(err)}
            if reply.get("status") != "ok":
                self._stop()
                problem = "cannot be imported" if reply["status"] == "error" else f"does not take the options {options}"
                raise RewardFailed(f"reward function {ref!r} {problem}: {reply['error']}")

    def _warn_of_gaps(self, hello: dict[str, Any]) -> None:
        """A warning for each protection the sandbox lacks, at its first call (a config check makes no call
        and stays quiet)."""
        functions = sorted({ref for ref, _ in self._functions})
        if missing := isolation_missing(hello):
            log.warning(
                "reward_sandbox_not_isolated",
                reason=missing,
                functions=functions,
                effect="user code runs as the worker's uid, with its network and files (`sandbox: unisolated`)",
                fix="allow unprivileged user namespaces (docs/sandbox.md)",
            )
        if hello["uid"] == 0:
            log.warning(
                "reward_sandbox_runs_as_root",
                functions=functions,
                effect="user code can lift its limits and read every file",
                fix="set sandbox.user to an unprivileged uid",
            )
        elif hello["unreadable"] is not None:
            log.warning(
                "reward_sandbox_reads_all_files",
                uid=hello["uid"],
                unreadable=hello["unreadable"],
                effect="it keeps CAP_DAC_READ_SEARCH: it can read every file, though not write, signal or trace",
                fix="make the Python installation and the import path readable for that uid",
            )

    def _request(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self._process is not None
        deadline = time.monotonic() + timeout_s
        self._process.sent += 1
        request["id"] = self._process.sent
        try:
            data = json.dumps(request).encode() + b"\n"
        except (TypeError, ValueError) as err:  # options YAML could hold, JSON cannot
            raise RewardFailed(describe(err)) from None
        try:
            self._process.write(data, deadline)
        except TimeoutError:
            self._abandon(request, timeout_s)
        except BrokenPipeError:
            self._died()
        reply = self._receive(request, timeout_s, deadline)
        if reply.get("id") != request["id"] or reply.get("status") not in ("ok", "error", "bad_options"):
            self._broken(f"a reply that is not the answer to request {request['id']}")
        if reply["status"] != "ok" and not isinstance(reply.get("error"), str):
            self._broken("an error reply without an error text")
        return reply

    def _value(self, reply: dict[str, Any]) -> RewardValue:
        """The value of an ok reply; one the child's own check would have refused means the reply is forged."""
        try:
            return checked(reply["value"])
        except (KeyError, TypeError, ValueError, OverflowError):
            self._broken("a value that is not a float or a dict of floats")

    def _batch_value(self, reply: dict[str, Any], count: int) -> list[float]:
        """The value of an ok batch reply; one the child's own check would have refused means the reply is forged."""
        try:
            return checked_batch(reply["value"], count)
        except (KeyError, TypeError, ValueError, OverflowError):
            self._broken(f"a value that is not a list of {count} floats")

    def _json_value(self, reply: dict[str, Any]) -> Any:
        if "value" not in reply:
            self._broken("an ok reply without a value")
        return reply["value"]

    def _receive(self, request: dict[str, Any], timeout_s: float, deadline: float) -> dict[str, Any]:
        """The next reply line as a dict; the sandbox is stopped and RewardFailed raised if there is none."""
        assert self._process is not None
        try:
            line = self._process.replies.line(deadline)
        except TimeoutError:
            self._abandon(request, timeout_s)
        except EOFError:
            self._died()
        except LineTooLong:
            self._broken(f"a reply of more than {MAX_REPLY_BYTES} bytes")
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            self._broken("a reply that is not JSON")
        if not isinstance(reply, dict):
            self._broken("a reply that is not a JSON object")
        return reply

    def _abandon(self, request: dict[str, Any], timeout_s: float) -> NoReturn:
        log.warning(
            "reward_timeout",
            request=request["op"],
            function=request.get("ref"),
            timeout_s=timeout_s,
            output_tail=self.output_tail(),
        )
        self._stop()
        raise RewardFailed(f"timed out after {timeout_s:g}s")

    def _died(self) -> NoReturn:
        assert self._process is not None
        pid, tail = self.pid, self.output_tail()
        code = self._stop()
        log.warning("reward_process_died", pid=pid, code=code, output_tail=tail)
        if code == EXIT_OUT_OF_MEMORY:  # the supervisor printed how much, into the tail logged above
            raise RewardFailed(
                f"RewardOutOfMemory: the sandbox's processes together held more than memory_mb "
                f"({self._settings.memory_mb})"
            )
        raise RewardFailed(f"RewardProcessDied: the reward process {_how_it_ended(code)}")

    def _broken(self, what: str) -> NoReturn:
        log.warning("reward_protocol_error", pid=self.pid, problem=what, output_tail=self.output_tail())
        self._stop()
        raise RewardFailed(f"RewardProtocolError: the reward process sent {what}")

    def _stop(self) -> int | None:
        """Kill the sandbox if there is one; the supervisor's exit code (the server's status)."""
        process, self._process = self._process, None
        return None if process is None else process.kill()


def isolation_missing(hello: dict[str, Any]) -> str | None:
    """What isolation a started sandbox lacks, in words (from its ready line), or None."""
    if hello["namespaces_refused"] is not None:
        return f"namespaces refused ({hello['namespaces_refused']})"
    if hello["view_refused"] is not None:
        return f"no private filesystem view ({hello['view_refused']})"
    return None


def _how_it_ended(code: int | None) -> str:
    """The supervisor's exit code in words: it exits with the server's code, or 128 + the signal that killed it."""
    if code is None:
        return "exited"
    number = -code if code < 0 else max(code - 128, 0)
    if not number:
        return f"exited (code {code})"
    try:
        return f"was killed by {signal.Signals(number).name}"
    except ValueError:
        return f"was killed by signal {number}"

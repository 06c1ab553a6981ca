"""The reward sandbox's child program: it confines itself, then runs user reward functions on request.

    python -m workers.rewards.sandbox.child SETTINGS_JSON

Started by `workers.rewards.sandbox.client.Sandbox`, never by hand; standard library only, so nothing but
this package's own files runs before the confinement. Two processes:

    supervisor  unshares the namespaces, forks the server (PID 1 of the new PID namespace), waits for it,
                and kills it when the lifeline pipe closes (the worker stopped the sandbox, or died), or
                when the resident memory of all its processes together passes `memory_bytes`
                (`workers.rewards.sandbox.memory`): the server's death takes every process of its
                namespace with it
    server      enters a mount namespace with a private read-only view of the filesystem
                (`workers.rewards.sandbox.view`), drops privileges, sets its rlimits, then answers one
                JSON line per request line:
                  {"id", "op": "load", "ref", "options", "batched"?}           import and check a function
                  {"id", "op": "call", "ref", "completion", "answer", "finish_reason", "options", "returns"?,
                   "prompt"?, "columns"?}
                  {"id", "op": "batch", "ref", "completions", "prompts", "answers", "finish_reasons",
                   "columns", "options"}                                       a batched reward, once per group
                with {"id", "status": "ok" | "error" | "bad_options", "value" | "error", "retire"?}
                A call's value is a float or a dict of floats (a reward), or, with `"returns": "json"`,
                any JSON value (a tool's result, which its caller checks); a batch's is a list of floats,
                one per completion. `prompt` and each column are passed as keyword arguments only to a
                function that declares them (or takes `**kwargs`); an option of the same name wins

The server's first line says what confinement it got ({"op": "ready", ...}) or why it has none
({"op": "failed", "error"}). `retire` asks the worker to replace it: it has used half its CPU budget.
Requests and replies travel on their own pipes, never stdout, so a function that prints cannot forge
or corrupt a reply; a reply larger than `max_reply_bytes` is turned into an error here (and refused
again by the worker, which trusts nothing it reads).
"""

from __future__ import annotations

import inspect
import json
import os
import resource
import select
import shutil
import signal
import sys
import traceback
from typing import Any, NoReturn

from workers.rewards.sandbox import confine, memory, view
from workers.rewards.values import RewardFn, accepted, checked, checked_batch, describe, import_function

_SAMPLE_ARGS = ("completion", "answer", "finish_reason")
_BATCH_ARGS = ("completions", "prompts", "answers")
"""The positional arguments of each form: a column of the same name is not passed again."""
MAX_ERROR_CHARS = 2000
"""An error message longer than this is cut (a function may raise with a huge message)."""


def main(argv: list[str]) -> NoReturn:
    """The supervisor: probe, unshare, fork the server, then wait for it or for the lifeline to close."""
    settings = json.loads(argv[1])
    user = settings["user"] if os.geteuid() == 0 else None
    unreadable = None if user is None else confine.first_unreadable(settings["paths"], user, settings["group"])
    namespaces, refused = confine.unshare_namespaces(settings["isolate_network"])
    memory.become_subreaper()
    facts = {"namespaces": namespaces, "namespaces_refused": refused, "unreadable": unreadable}
    server = os.fork()
    if server == 0:
        try:
            os.close(settings["lifeline"])
            _run_server(settings, user, facts)
        finally:  # whatever happens, the server never runs on into the supervisor's code
            os._exit(1)
    os.close(settings["requests"])
    os.close(settings["replies"])
    _supervise(server, settings["lifeline"], settings["home"], settings["memory_bytes"])


def _supervise(server: int, lifeline: int, home: str, memory_bytes: int | None) -> NoReturn:
    """Exit with the server's status; kill it (and what is left of the group) if the lifeline closes, or
    with `memory.EXIT_OUT_OF_MEMORY` when the sandbox's processes together hold more than `memory_bytes`.

    Either way the sandbox's HOME goes too: the worker may have died without removing it."""
    try:
        pidfd: int | None = os.pidfd_open(server)
    except OSError:  # a kernel before 5.3: only the lifeline wakes us
        pidfd = None
    watched = [lifeline] if pidfd is None else [pidfd, lifeline]
    poll_s = None if memory_bytes is None else memory.POLL_S
    over: tuple[int, int] | None = None
    while not (ready := select.select(watched, [], [], poll_s)[0]):
        if memory_bytes is not None and (over := memory.over_limit(os.getpid(), memory_bytes)) is not None:
            break
    if over is not None:  # every process below this one (a subreaper: orphans included), then the report
        memory.kill_tree(os.getpid())  # reaps the server too
        shutil.rmtree(home, ignore_errors=True)
        print(memory.report(*over, memory_bytes or 0), file=sys.stderr, flush=True)
        os._exit(memory.EXIT_OUT_OF_MEMORY)
    stopped = pidfd not in ready
    if stopped:
        os.kill(server, signal.SIGKILL)
    _, status = os.waitpid(server, 0)
    shutil.rmtree(home, ignore_errors=True)
    if stopped:  # without a PID namespace, grandchildren may remain in the group; this process goes too
        os.killpg(0, signal.SIGKILL)
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


def _run_server(settings: dict[str, Any], user: int | None, facts: dict[str, Any]) -> NoReturn:
    replies = settings["replies"]
    try:
        _confine(settings, user, facts)
    except Exception as err:  # deliberate: report why and stop, before any user code has run
        _send(replies, {"op": "failed", "error": _describe(err)}, settings["max_reply_bytes"])
        os._exit(1)
    ready = {"op": "ready", "pid": os.getpid(), "uid": os.getuid(), **facts}
    _send(replies, ready, settings["max_reply_bytes"])
    code: Any = 0
    try:
        _serve(settings["requests"], replies, settings["max_reply_bytes"], settings["cpu_s"])
    except SystemExit as exit_:  # user code called sys.exit: the worker sees the process die
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # deliberate: nothing may unwind into the supervisor's code of this fork
        traceback.print_exc()  # into the output tail the worker logs
        code = 1
    _flush_output()
    os._exit(code)


def _confine(settings: dict[str, Any], user: int | None, facts: dict[str, Any]) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE fails instead of killing
    signal.signal(signal.SIGXCPU, _out_of_cpu)  # PID 1 of a namespace ignores a signal left at its default
    facts["view_refused"] = "no namespaces" if facts["namespaces_refused"] is not None else None
    facts["proc"] = None
    if facts["view_refused"] is None:  # the view's mounts need the capabilities dropped below
        owner = (os.getuid(), os.getgid()) if user is None else (user, settings["group"])
        try:
            facts["proc"] = view.build(
                settings["paths"], settings["hidden"], settings["home"], settings["scratch_bytes"], owner
            )
        except OSError as err:
            facts["view_refused"] = str(err)
    if user is not None:
        confine.drop_privileges(user, settings["group"], keep_read_all=facts["unreadable"] is not None)
    elif "user" in facts["namespaces"]:
        confine.drop_capabilities()
    facts["limits"] = confine.set_limits(
        settings["memory_bytes"],
        settings["cpu_s"],
        settings["processes"],
        settings["open_files"],
        settings["file_bytes"],
    )
    confine.forbid_new_privileges()


def _out_of_cpu(signum: int, frame: object) -> None:
    """RLIMIT_CPU's soft limit: exit as if killed by SIGXCPU (the hard limit's SIGKILL follows a second later)."""
    os._exit(128 + signum)


def _serve(requests_fd: int, replies_fd: int, max_reply_bytes: int, cpu_s: int) -> None:
    """Answer request lines until the worker closes the pipe."""
    functions: dict[str, RewardFn] = {}
    server_pid = os.getpid()
    with os.fdopen(requests_fd, "rb") as requests:
        for line in requests:
            request = json.loads(line)
            reply = _answer(request, functions)
            if os.getpid() != server_pid:  # a fork made by user code came back here: it must not answer
                os._exit(0)
            reply["id"] = request["id"]
            usage = resource.getrusage(resource.RUSAGE_SELF)
            if usage.ru_utime + usage.ru_stime > cpu_s / 2:
                reply["retire"] = True
            _flush_output()
            _send(replies_fd, reply, max_reply_bytes)


def _answer(request: dict[str, Any], functions: dict[str, RewardFn]) -> dict[str, Any]:
    try:
        if request["op"] == "load":
            functions[request["ref"]] = fn = import_function(request["ref"])
            problem = _options_problem(fn, request["options"], request.get("batched", False))
            return {"status": "ok"} if problem is None else {"status": "bad_options", "error": problem}
        fn = functions[request["ref"]]
        options = request["options"]
        if request["op"] == "batch":
            extra = accepted(fn, {**request["columns"], "finish_reasons": request["finish_reasons"]})
            extra = {k: v for k, v in extra.items() if k not in options and k not in _BATCH_ARGS}
            completions = request["completions"]
            value = fn(completions, request["prompts"], request["answers"], **extra, **options)
            return {"status": "ok", "value": checked_batch(value, len(completions))}
        extra = accepted(fn, {**request.get("columns", {}), "prompt": request.get("prompt")})
        extra = {k: v for k, v in extra.items() if k not in options and k not in _SAMPLE_ARGS}
        value = fn(request["completion"], request["answer"], request["finish_reason"], **extra, **options)
        if request.get("returns") == "json":
            json.dumps(value, allow_nan=False)  # what `_send` writes: refused here, as the function's error
            return {"status": "ok", "value": value}
        return {"status": "ok", "value": checked(value)}
    except Exception as err:  # deliberate: user code faults are reported to the worker, not fatal
        return {"status": "error", "error": _describe(err)}


def _options_problem(fn: RewardFn, options: dict[str, Any], batched: bool = False) -> str | None:
    """Why `fn` cannot be called with these options, or None (also when it has no signature to check). Partly
    bound: the parameters left may be filled by `prompt` and the item's columns."""
    try:
        signature = inspect.signature(fn)
    except ValueError:  # some builtins have no signature to check
        return None
    try:
        signature.bind_partial(*(([], [], []) if batched else ("", None, "stop")), **options)
    except TypeError as err:
        return str(err)
    return None


def _describe(err: BaseException) -> str:
    try:
        text = describe(err)
    except Exception:  # deliberate: an exception whose __str__ raises still gets a name
        text = type(err).__name__
    return text[:MAX_ERROR_CHARS]


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # deliberate: user code may have closed or broken its own output
            pass


def _send(fd: int, reply: dict[str, Any], max_bytes: int) -> None:
    data = json.dumps(reply).encode() + b"\n"
    if len(data) > max_bytes:
        error = f"RewardReplyTooLarge: the reply is {len(data)} bytes, more than the {max_bytes} allowed"
        data = json.dumps({"id": reply.get("id"), "status": "error", "error": error}).encode() + b"\n"
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


if __name__ == "__main__":
    main(sys.argv)

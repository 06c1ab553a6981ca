"""Hostile reward functions for the sandbox tests; only the sandbox child imports them.

Each one behaves (returns 1.0) unless the completion names its attack, so a test can check that the
sandbox it broke answers again afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time


def fork_bomb(completion: str, answer: str | None, finish_reason: str) -> float:
    """Forks forever, every copy too, shrugging off each refused fork."""
    if completion != "bomb":
        return 1.0
    while True:
        try:
            os.fork()
        except OSError:
            pass


def memory_hog(completion: str, answer: str | None, finish_reason: str) -> float:
    """Allocates (and touches) 64 MiB after 64 MiB until something gives."""
    if completion != "hog":
        return 1.0
    chunks = []
    while True:
        chunks.append(b"x" * (64 << 20))


def chatty(completion: str, answer: str | None, finish_reason: str) -> float:
    """Prints 100 MB, then a marker, and scores 1.0."""
    if completion == "print":
        sys.stdout.write("x" * 100_000_000)
        print("END-OF-OUTPUT")
    return 1.0


def huge(completion: str, answer: str | None, finish_reason: str) -> object:
    """Returns a 100 MB string, or a dict whose one key is 2 MB long."""
    if completion == "string":
        return "x" * 100_000_000
    if completion == "key":
        return {"x" * 2_000_000: 1.0}
    return 1.0


def environment(completion: str, answer: str | None, finish_reason: str, worker_pid: int) -> dict[str, float]:
    """What of the worker's environment it sees, each answer a component (1.0 = visible)."""
    try:
        with open(f"/proc/{worker_pid}/environ", "rb") as file:
            worker_environ = float(b"RELAX_PASSWORD" in file.read())
    except OSError:
        worker_environ = 0.0
    return {
        "relax": float(any(name.startswith("RELAX_") for name in os.environ)),
        "nats": float(any("NATS" in name.upper() for name in os.environ)),
        "password": float(any("s3cret" in value for value in os.environ.values())),
        "token": float("SOME_API_TOKEN" in os.environ),
        "passed_on": float(os.environ.get("HF_HOME") == "/models/hf"),
        "private_home": float(os.path.basename(os.environ["HOME"]).startswith("relax-reward-")),
        "worker_environ": worker_environ,
    }


def spawns_and_hangs(completion: str, answer: str | None, finish_reason: str, marker: str) -> float:
    """Starts two sleeping grandchildren named `marker`-group and `marker`-session (the second in a
    session of its own, out of the process group), then hangs; or, on "leave", returns at once."""
    sleep = shutil.which("sleep") or "/bin/sleep"
    subprocess.Popen([f"{marker}-group", "1000"], executable=sleep)
    subprocess.Popen([f"{marker}-session", "1000"], executable=sleep, start_new_session=True)
    if completion == "leave":
        return 1.0
    time.sleep(1000)
    return 1.0


def connects(completion: str, answer: str | None, finish_reason: str, port: int) -> float:
    """1.0 when a TCP connection to 127.0.0.1:`port` succeeds."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return 0.0
    return 1.0


def forges_replies(completion: str, answer: str | None, finish_reason: str) -> float:
    """Writes straight to the sandbox's reply pipe: a line that is not JSON, 2 MiB without a newline,
    or a reply to the current request with a value of the wrong type."""
    replies = json.loads(sys.argv[1])["replies"]
    if completion == "junk":
        os.write(replies, b"this is not json\n")
    elif completion == "long":
        os.write(replies, b"x" * (2 << 20))
    elif completion == "wrong_type":
        request_id = sys._getframe(1).f_locals["request"]["id"]
        os.write(replies, json.dumps({"id": request_id, "status": "ok", "value": "high"}).encode() + b"\n")
    return 1.0


def writes_file(completion: str, answer: str | None, finish_reason: str, megabytes: int) -> float:
    """Writes `megabytes` MiB to a file in its HOME."""
    with open(os.path.join(os.environ["HOME"], "big.bin"), "wb") as file:
        file.write(b"x" * (megabytes << 20))
    return 1.0


def opens_files(completion: str, answer: str | None, finish_reason: str, count: int) -> float:
    """Opens /dev/null `count` times, keeping every file open."""
    with contextlib.ExitStack() as files:
        for _ in range(count):
            files.enter_context(open(os.devnull))
    return 1.0


def burns_cpu(completion: str, answer: str | None, finish_reason: str, cpu_s: float) -> float:
    """On "burn", spins until this process has used `cpu_s` seconds of CPU in all."""
    while completion == "burn" and time.process_time() < cpu_s:
        pass
    return 1.0


def escape(
    completion: str, answer: str | None, finish_reason: str, worker_pid: int, secret_file: str, module: str, port: int
) -> dict[str, float]:
    """Every way out the sandbox must close, each a component (1.0 = it got out): the worker's environ and
    memory through /proc, a 0600 credentials file of the worker's uid, the bus's port on 127.0.0.1, a
    module file on the worker's import path (overwritten for the worker's next import), and any writable
    place outside its scratch (the working directory)."""
    found: dict[str, float] = {}
    try:
        with open(f"/proc/{worker_pid}/environ", "rb") as file:
            found["environ"] = float(b"s3cret" in file.read())
    except OSError:
        found["environ"] = 0.0
    try:
        with open(f"/proc/{worker_pid}/mem", "r+b") as file:
            found["memory"] = 1.0
    except OSError:
        found["memory"] = 0.0
    try:
        with open(secret_file) as file:
            found["credentials_file"] = float("s3cret" in file.read())
    except OSError:
        found["credentials_file"] = 0.0
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        found["network"] = 1.0
    except OSError:
        found["network"] = 0.0
    try:
        with open(module, "w") as file:
            file.write("PLANTED = True\n")
        found["import_path"] = 1.0
    except OSError:
        found["import_path"] = 0.0
    try:
        with open(os.path.join(os.getcwd(), "planted.txt"), "w") as file:
            file.write("x")
        found["working_directory"] = 1.0
    except OSError:
        found["working_directory"] = 0.0
    scratch = os.path.join(os.environ["HOME"], "scratch.txt")
    with open(scratch, "w") as file:
        file.write("x")
    found["scratch_writable"] = float(os.path.exists(scratch))
    return found


def memory_tree(completion: str, answer: str | None, finish_reason: str, children: int, megabytes: int) -> float:
    """On "fork", starts `children` processes that each touch `megabytes` MiB and wait; each alone stays
    under the sandbox's memory limit, together they do not."""
    if completion != "fork":
        return 1.0
    for _ in range(children):
        if os.fork() == 0:
            held = bytearray(megabytes << 20)
            for i in range(0, len(held), 4096):
                held[i] = 1
            time.sleep(1000)
            os._exit(0)
    time.sleep(1000)
    return 1.0

"""One memory limit for the whole reward sandbox: the resident memory of all its processes together.

RLIMIT_AS bounds each process on its own, so a function that forks N children could hold N times
`memory_mb`. The sandbox's supervisor is therefore a child subreaper (every orphan of the tree becomes its
child, whatever session or process group it moved to) and polls, every `POLL_S`, the resident set of
every process below it (`/proc/<pid>/stat`, readable whatever uid the process runs as); past the limit it
kills them all and exits with `EXIT_OUT_OF_MEMORY`, which the worker reports as a reward error.

What this bounds, and what it does not: each process stays under its RLIMIT_AS at every instant; the sum
is checked every 50 ms, so between two checks the tree may hold more, by at most what it can fault in
within 50 ms (page faults run at a few GB/s: on the order of 100 MiB). A memory cgroup would bound it
exactly, but needs a delegated, writable cgroup v2 subtree, which neither the shipped containers nor an
unprivileged worker has; a container's own memory limit is the exact bound there. Memory of files in
the scratch tmpfs is bounded by its own size (`scratch_mb`), not counted here. Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import signal

POLL_S = 0.05
"""How often the supervisor adds up the sandbox's resident memory."""
EXIT_OUT_OF_MEMORY = 99
"""The supervisor's exit code when it killed the sandbox for holding more than its memory limit."""
_PR_SET_CHILD_SUBREAPER = 36
_PAGE = os.sysconf("SC_PAGE_SIZE")


def become_subreaper() -> None:
    """Orphans among this process's descendants become its children (not init's): the tree stays whole."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(errno)}")


def descendants(root: int) -> dict[int, int]:
    """Resident bytes of every live process below `root`, by PID (from /proc/<pid>/stat)."""
    children: dict[int, list[int]] = {}
    resident: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as file:
                fields = file.read().rpartition(b")")[2].split()
        except OSError:  # deliberate: it exited while we looked
            continue
        pid = int(name)
        children.setdefault(int(fields[1]), []).append(pid)
        if fields[0] not in (b"Z", b"X"):  # a zombie holds no memory, and cannot be killed again
            resident[pid] = int(fields[21]) * _PAGE
    found: dict[int, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in resident:
            found[pid] = resident[pid]
        todo += children.get(pid, [])
    return found


def over_limit(root: int, limit_bytes: int) -> tuple[int, int] | None:
    """(resident bytes, processes) of the tree below `root` when together they hold more than `limit_bytes`."""
    tree = descendants(root)
    total = sum(tree.values())
    return (total, len(tree)) if total > limit_bytes else None


def kill_tree(root: int) -> None:
    """SIGKILL every process below `root`, until none is left (a fork racing the kill is caught next round)."""
    while tree := descendants(root):
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap()
    _reap()


def _reap() -> None:
    """Reap every child of ours that has exited (the server, reparented orphans)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def report(resident: int, processes: int, limit_bytes: int) -> str:
    """The line the worker records as the reward error."""
    return (
        f"RewardOutOfMemory: the sandbox's {processes} processes held {resident >> 20} MiB together, "
        f"more than its memory_mb ({limit_bytes >> 20})"
    )

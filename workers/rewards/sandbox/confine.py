"""Linux confinement steps for the reward sandbox: namespaces, a lesser uid, no capabilities, rlimits.

Standard library only (libc through ctypes: Python 3.11 has no `os.unshare`). Each step is a small
function the sandbox child calls on itself, in this order, before it imports any user code:

    unshare_namespaces   a PID namespace, a network namespace (a loopback that is down) and, when not
                         root, the user namespace that lets an unprivileged process create them
    first_unreadable     (root only) whether the lesser uid can read the interpreter and the import path
    drop_privileges      (root only) switch to that uid/gid; keep CAP_DAC_READ_SEARCH only if it cannot
    drop_capabilities    (not root) the capabilities a new user namespace grants, gone
    set_limits           RLIMIT_AS, CPU, NPROC, NOFILE, FSIZE, CORE
    forbid_new_privileges  no setuid binary or file capability can give any of it back
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
_PR_SET_KEEPCAPS = 8
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_RAISE = 2
_CAP_DAC_READ_SEARCH = 2
_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def unshare_namespaces(network: bool) -> tuple[list[str], str | None]:
    """Move this process into new namespaces (its next child is PID 1 of the new PID namespace).

    Returns the namespaces made, and why there are none (the kernel's refusal) or None. Must run while
    the process has a single thread (a user namespace requires it)."""
    if sys.platform != "linux":
        return [], f"namespaces need Linux, not {sys.platform}"
    flags = CLONE_NEWPID | (CLONE_NEWNET if network else 0)
    uid, gid = os.getuid(), os.getgid()
    unprivileged = os.geteuid() != 0
    if unprivileged:
        flags |= CLONE_NEWUSER
    try:
        _check(_libc().unshare(flags), "unshare")
    except OSError as err:
        return [], str(err)
    made = ["pid", *(["net"] if network else []), *(["user"] if unprivileged else [])]
    if unprivileged:  # map our own ids, so that files keep their owners inside
        try:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
        except OSError as err:
            return made, f"uid map: {err}"
    return made, None


def _write(path: str, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)


def first_unreadable(paths: list[str], uid: int, gid: int) -> str | None:
    """The first of `paths` that `uid` cannot read (probed by a throwaway child), or None."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the probe: switch, try each path, report the first failure, exit
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            for path in paths:
                try:
                    if os.path.isdir(path):
                        os.listdir(path)
                    else:
                        open(path, "rb").close()
                except OSError:
                    os.write(write, path.encode())
                    break
        finally:
            os._exit(0)
    os.close(write)
    found = b""
    while chunk := os.read(read, 4096):
        found += chunk
    os.close(read)
    os.waitpid(pid, 0)
    return found.decode(errors="replace") or None


def drop_privileges(uid: int, gid: int, keep_read_all: bool) -> None:
    """Root only: become `uid`/`gid` with no supplementary groups, and so lose every capability.

    `keep_read_all` keeps CAP_DAC_READ_SEARCH (and hands it to exec'd programs): the process reads any
    file but writes, signals and traces only as `uid`, and cannot lift its limits. It is for an
    interpreter installed where `uid` cannot read (a pyenv under /root)."""
    libc = _libc()
    if keep_read_all:
        _check(libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if keep_read_all:
        _capset(1 << _CAP_DAC_READ_SEARCH)
        _check(libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, _CAP_DAC_READ_SEARCH, 0, 0), "prctl(ambient)")
        _check(libc.prctl(_PR_SET_KEEPCAPS, 0, 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")


def drop_capabilities() -> None:
    """Give up every capability (those a new user namespace grants inside it included)."""
    _capset(0)


def _capset(mask: int) -> None:
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)(_CapData(mask, mask, mask), _CapData(0, 0, 0))
    _check(_libc().capset(ctypes.byref(header), data), "capset")


def forbid_new_privileges() -> None:
    """PR_SET_NO_NEW_PRIVS: no execve (setuid binary, file capabilities) can raise the privileges again."""
    _check(_libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def set_limits(
    memory_bytes: int | None, cpu_s: int, processes: int, open_files: int, file_bytes: int
) -> dict[str, int | None]:
    """Set soft and hard rlimits (never above a hard limit already there); returns the soft limits set."""
    wanted = {
        "RLIMIT_AS": memory_bytes,
        "RLIMIT_CPU": cpu_s,
        "RLIMIT_NPROC": processes,
        "RLIMIT_NOFILE": open_files,
        "RLIMIT_FSIZE": file_bytes,
        "RLIMIT_CORE": 0,
    }
    applied: dict[str, int | None] = {}
    for name, value in wanted.items():
        if value is None:
            applied[name] = None
            continue
        which = getattr(resource, name)
        _, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        # one second of grace above the CPU soft limit: its SIGXCPU, not the hard limit's SIGKILL, names the cause
        ceiling = value + 1 if name == "RLIMIT_CPU" and hard == resource.RLIM_INFINITY else value
        resource.setrlimit(which, (value, ceiling))
        applied[name] = value
    return applied

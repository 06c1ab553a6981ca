"""The reward sandbox's private filesystem view: a mount namespace whose root is a read-only tmpfs holding
only what user code needs to import and run, and one writable scratch tmpfs.

    /usr /bin /sbin /lib* /etc          the system, read-only (symlinked top-level dirs stay symlinks)
    the interpreter's prefixes          read-only
    the worker's import path and cwd    read-only (bound at their real paths and at the paths as given)
    `hidden`                            masked: an empty read-only tmpfs over a directory, /dev/null over a file
    /dev                                null, zero, full, random, urandom, and a shm in the scratch
    /proc                               a procfs of the sandbox's own PID namespace (left empty where refused)
    HOME (= TMPDIR) and /tmp            one tmpfs of `scratch_bytes`, the only place user code can write

Nothing else of the host exists in it: no run directory, no credentials directory, no other user's home,
no /var/run/secrets. `build` runs in the sandbox server (PID 1 of its PID namespace) while it still holds
the capabilities of its user namespace (or is root), before it drops them. Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import sys

from workers.rewards.sandbox.confine import _check, _libc

CLONE_NEWNS = 0x00020000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_NOATIME = 1024
_MS_NODIRATIME = 2048
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MS_RELATIME = 1 << 21
_MNT_DETACH = 2
_KEPT_FLAGS = {
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": _MS_NOATIME,
    "nodiratime": _MS_NODIRATIME,
    "relatime": _MS_RELATIME,
}
"""Per-mount flags a read-only remount must repeat: a user namespace may not clear those it inherited."""
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
"""pivot_root's syscall number (glibc has no wrapper)."""
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_OCTAL = re.compile(r"\\([0-7]{3})")
DEVICES = ("null", "zero", "full", "random", "urandom")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731 - four arguments, one conversion
    _check(_libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def build(paths: list[str], hidden: list[str], home: str, scratch_bytes: int, owner: tuple[int, int]) -> bool:
    """Enter a new mount namespace and make the view above its root; chdir to the worker's cwd (the last of
    `paths`) when it is in the view, else to `home`. `owner` owns the scratch. Returns whether /proc is
    mounted. OSError when any step is refused (the sandbox then has no private view)."""
    _check(_libc().unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing mounted below reaches the worker's namespace
    root = home  # an empty directory of ours, as the staging point (the scratch is mounted at its path inside)
    _mount("relax-sandbox", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=4m,mode=0755")
    bound: list[str] = []
    for path in SYSTEM:
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path):
            _bind(root, path, path, bound)
    interpreter = (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)))
    shown = {p for entry in (*paths, *interpreter) for p in (os.path.realpath(entry), os.path.abspath(entry))}
    for path in sorted(shown):
        if os.path.exists(path):
            _bind(root, os.path.realpath(path), path, bound)
    _devices(root)
    uid, gid = owner
    scratch = root + home
    os.makedirs(scratch, exist_ok=True)
    options = f"size={scratch_bytes},mode=0700,uid={uid},gid={gid}"
    _mount("relax-scratch", scratch, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
    writable = [scratch]
    for alias in ("/tmp", "/dev/shm"):
        if not os.path.exists(root + alias):  # not where the import path or the working directory is
            os.makedirs(root + alias)
            _mount(scratch, root + alias, None, _MS_BIND)
            writable.append(root + alias)
    for path in hidden:
        _hide(root, path)
    os.makedirs(root + "/proc", exist_ok=True)
    _read_only(root, writable)
    os.chdir(root)
    _check(_libc().syscall(_PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")
    _check(_libc().umount2(b".", _MNT_DETACH), "umount the host's root")
    os.chdir("/")
    try:
        _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        proc = True
    except OSError:  # deliberate: a container's masked /proc forbids a new one; the view then has none
        proc = False
    cwd = paths[-1] if paths else home
    os.chdir(cwd if os.path.isdir(cwd) else home)
    return proc


def _inside(path: str, parents: list[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def _bind(root: str, source: str, path: str, bound: list[str]) -> None:
    """Bind `source` (recursively) at `path` of the view, unless `path` is already visible through a bind,
    or a directory on its way is a bind (creating it would write to the host)."""
    if _inside(path, bound):
        return
    parent = os.path.dirname(path)
    if _inside(os.path.realpath(root + parent), [root + b for b in bound]):
        return  # reached through a top-level symlink into a bound tree: visible already, or not at all
    os.makedirs(root + parent, exist_ok=True)
    if os.path.isdir(source):
        os.makedirs(root + path, exist_ok=True)
    elif not os.path.exists(root + path):
        open(root + path, "x").close()
    _mount(source, root + path, None, _MS_BIND | _MS_REC)
    bound.append(path)


def _devices(root: str) -> None:
    os.makedirs(root + "/dev", exist_ok=True)
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            open(f"{root}/dev/{name}", "x").close()
            _mount(f"/dev/{name}", f"{root}/dev/{name}", None, _MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "fd/0"), ("stdout", "fd/1"), ("stderr", "fd/2")):
        os.symlink(target, f"{root}/dev/{name}")


def _hide(root: str, path: str) -> None:
    """An empty read-only tmpfs over a directory of the view, /dev/null over a file; nothing if not in it."""
    target = root + path
    if os.path.isdir(target):
        _mount("relax-hidden", target, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_RDONLY, "size=4k,mode=0500")
    elif os.path.exists(target):
        _mount(root + "/dev/null", target, None, _MS_BIND)


def _read_only(root: str, writable: list[str]) -> None:
    """Remount every mount of the view at `root` read-only, except `writable` (and what is below them)."""
    for point, options in _mounts():
        if not _inside(point, [root]) or _inside(point, writable) or "ro" in options:
            continue
        kept = sum(flag for name, flag in _KEPT_FLAGS.items() if name in options)
        _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept)


def _mounts() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of every mount of this namespace, from /proc/self/mountinfo."""
    found = []
    with open("/proc/self/mountinfo") as file:
        for line in file:
            fields = line.split()
            point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])  # \040 is a space
            found.append((point, set(fields[5].split(","))))
    return found

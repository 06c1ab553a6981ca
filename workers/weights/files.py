"""The two transports that keep whole safetensors files where the engines can read them (`filesystem` on
storage every worker mounts, `shm` in one host's shared memory).

A file is laid out as `workers.weights.serialization` says, so a reader builds the tensors as views into the
bytes it read or mapped. A publisher writes a temp file and renames it into place (a reader sees a whole file
or none); a temp file left by a publisher killed mid-write is removed by the next publish. A reader with
`verify` checks the digest and refuses a file whose bytes differ from what was published (`BlobCorrupt`).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import re
import shutil
import socket
import stat
from pathlib import Path

from relax_bus.errors import BlobNotFound
from schemas import WeightsAnnouncement
from workers.weights.serialization import check_digest, from_buffer, layout, tensor_bytes
from workers.weights.transport import StateDict

DONE = re.compile(r"v(\d+)\.safetensors")
TEMP = re.compile(r"\.v(\d+)\.safetensors\.tmp-(.+)-(\d+)")
"""A publisher's temp file: `.v<version>.safetensors.tmp-<host>-<pid>`."""


def write_at(fd: int, offset: int, data: memoryview) -> None:
    """Write all of `data` at `offset` (a plain write: on tmpfs about twice as fast as faulting in a mapping)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + (1 << 26)], offset + done)


def write_file(path: Path, state: StateDict) -> int:
    """Write `state` laid out by `layout` to a temp file next to `path` (mode 0600), then rename it into place;
    returns the size. A temp file is removed on an error; one left by a SIGKILL is removed by `prune`."""
    header, slots = layout(state)
    size = len(header) + sum(t.numel() * t.element_size() for _, t in slots)
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
        write_at(fd, 0, memoryview(header))
        for offset, tensor in slots:
            write_at(fd, offset, tensor_bytes(tensor))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    tmp.rename(path)  # readers see a whole file or none
    return size


def prune(folder: Path, newest: int, keep: int) -> None:
    """After publishing `newest`: remove every version between v0 and the newest `keep` (v0 stays: the reference
    role and restarts from scratch read it), and temp files no live publisher will finish: those of a version
    up to `newest` (a publisher that still writes one is dead or fenced) and those of a dead process here."""
    host = socket.gethostname()
    for entry in folder.iterdir():
        done, temp = DONE.fullmatch(entry.name), TEMP.fullmatch(entry.name)
        old = done is not None and 0 < int(done[1]) <= newest - keep
        orphan = temp is not None and (int(temp[1]) <= newest or (temp[2] == host and not pid_alive(int(temp[3]))))
        if old or orphan:
            entry.unlink(missing_ok=True)


async def publish_file(
    folder: Path, run: str, keep: int, transport: str, version: int, state: StateDict, step: int
) -> WeightsAnnouncement:
    """Write `folder/v<version>.safetensors` (in a thread: seconds for a real model), prune, announce."""
    path = folder / f"v{version}.safetensors"
    size = await asyncio.to_thread(write_file, path, state)
    prune(folder, version, keep)
    return WeightsAnnouncement(run=run, version=version, transport=transport, location=str(path), size=size, step=step)


def kept_versions(folder: Path) -> list[int]:
    return sorted(int(m[1]) for p in folder.iterdir() if (m := DONE.fullmatch(p.name)))


class FilesystemTransport:
    """Weights as `<root>/<run>/v<version>.safetensors` on a filesystem every worker mounts
    (`weights: {type: filesystem, root: DIR}`); keeps v0 and the newest `keep`. With `verify` (the default:
    shared storage can serve a truncated or damaged file) a fetch checks the data's SHA-256."""

    def __init__(self, run: str, keep: int, root: Path, verify: bool = True) -> None:
        self.run = run
        self.keep = keep
        self.verify = verify
        self.dir = root / run
        self.dir.mkdir(parents=True, exist_ok=True)

    async def publish(self, version: int, state: StateDict, step: int) -> WeightsAnnouncement:
        return await publish_file(self.dir, self.run, self.keep, "filesystem", version, state, step)

    async def read(self, version: int) -> StateDict:
        path = self.dir / f"v{version}.safetensors"
        try:
            data = await asyncio.to_thread(read_whole, path)
        except FileNotFoundError:
            raise BlobNotFound(
                f"filesystem weights v{version} of run {self.run}: no file {path} (kept: {kept_versions(self.dir)}; "
                f"is {self.dir} shared by every process of the run?)"
            ) from None
        if self.verify:
            await asyncio.to_thread(check_digest, data, f"filesystem weights {path}")
        return from_buffer(data)

    async def expect(self, version: int) -> None:
        """Nothing to start early: a version's file appears whole, at its rename."""


def read_whole(path: Path) -> bytearray:
    """A file's bytes in one writable buffer (tensors become views into it)."""
    with open(path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(data)
    return data


class SharedMemoryTransport:
    """Weights as `<root>/relax-<uid>/<run>/v<version>.safetensors` in shared memory (tmpfs) for a trainer
    and engines on one host (`weights: {type: shm}`); keeps v0 and the newest `keep`.

    Publish writes every tensor once, straight into a temp segment (`write_file`), then renames it into
    place: a reader sees a whole segment or none, and the announcement follows the rename. Fetch maps the
    segment copy-on-write and returns tensors that are views into it, so the engine's in-place load is the
    only copy; a write into a view stays private to that process, and a pruned segment stays readable by
    whoever still maps it (its memory is freed when the last view goes). `verify` (off by default: the
    segment never leaves this host's memory and this uid) checks the data's SHA-256 on every fetch, a pass
    over the segment.

    Lifetime: only the publisher unlinks. Each publish prunes every version between v0 and the newest
    `keep` and the temp segments no live publisher will finish (`prune`), so after a crash the segments
    stay until the next publish; `remove_run` deletes a finished run's folder.
    Safety: the folder is created 0700 and checked to be this uid's own, each segment is created 0600.
    """

    def __init__(self, run: str, keep: int, root: Path = Path("/dev/shm"), verify: bool = False) -> None:
        self.run = run
        self.keep = keep
        self.verify = verify
        self.dir = root / f"relax-{os.getuid()}" / run

    async def publish(self, version: int, state: StateDict, step: int) -> WeightsAnnouncement:
        for folder in (self.dir.parent, self.dir):
            private_dir(folder)
        return await publish_file(self.dir, self.run, self.keep, "shm", version, state, step)

    async def read(self, version: int) -> StateDict:
        path = self.dir / f"v{version}.safetensors"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise BlobNotFound(self._missing(version)) from None
        try:
            for folder in (self.dir.parent, self.dir):
                check_private(folder)
            mapped = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)  # the mapping keeps the segment alive
        if self.verify:
            await asyncio.to_thread(check_digest, mapped, f"shm weights {path}")
        return from_buffer(mapped)

    async def expect(self, version: int) -> None:
        """Nothing to start early: a version's segment appears whole, at its rename."""

    def remove_run(self) -> None:
        """Delete every segment of the run (when it is over; a fetch afterwards raises BlobNotFound)."""
        shutil.rmtree(self.dir, ignore_errors=True)

    def _missing(self, version: int) -> str:
        if not self.dir.is_dir():
            return (
                f"shm weights: no segments of run {self.run} in {self.dir} on this host (the shm transport "
                "needs the trainer and every engine on one host; use object_store or filesystem across hosts)"
            )
        return f"shm weights v{version} of run {self.run} are gone from {self.dir} (kept: {kept_versions(self.dir)})"


def private_dir(path: Path) -> None:
    """Create `path` with mode 0700 if missing; refuse one that is not this uid's own or others may write."""
    path.mkdir(mode=0o700, exist_ok=True)
    check_private(path)


def check_private(path: Path) -> None:
    """Refuse a folder another uid owns or may write (it could plant or swap segments)."""
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise PermissionError(
            f"shm weights: {path} must be a directory owned by uid {os.getuid()} that only it can write"
        )


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (a temp segment of a dead one is garbage)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another uid
        return True
    return True

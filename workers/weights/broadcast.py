"""`broadcast`: the trainer pushes each version to every rollout engine over a torch.distributed gloo group, while
the same version goes into the object store, which stays the source of truth (`weights: {type: broadcast}`).

Who meets whom. The publisher (the trainer's rank 0) hosts a `TCPStore` and names its address in the run's state
KV (`weights.broadcast`). A reader joins on its first fetch of a version after v0 (which the object store serves):
it connects to the store, takes a ticket, and from then on bumps a beat counter while it waits for rounds. Each
publish is one round:

    members    tickets whose beat moved within `timeout_s` (a reader that stopped beating is left out)
    epoch      a new gloo group (rank 0 the publisher, ranks 1.. the members, in ticket order) when the
               members changed or the last round failed; otherwise the group of the last round is reused
    round/<r>  JSON: version, epoch, members, the bucket layout (and a sha256 per bucket with `verify`)
    buckets    tensors packed into buckets of about `bucket_mb` (a larger tensor goes alone, without a copy),
               one gloo broadcast each; a reader's tensors are views into the buckets it received

A reader that joins, leaves or dies costs nobody a restart: the next round forms a new group without it or with
it. The reference role (v0 only) and a trainer restarting before its first checkpoint never join; a rollout worker
that starts with the run joins at v1 (read from the store). What a member costs: one that dies inside a round
makes that round fail for everyone after `timeout_s`, and every member then reads that version from the object
store, as does a reader that joined after the round began or missed it; a new trainer (after a crash) opens a new
store and readers follow the KV key to it.
`read(v)` returns the broadcast copy when this reader received `v` (it waits for a round of `v` still in
flight), and the object store's otherwise. The data plane carries no authentication: use it on a network where
every host that can reach the store's port is trusted (docs/engines.md).
"""

from __future__ import annotations

import asyncio
import atexit
import datetime
import hashlib
import json
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from relax_bus.bus import Bus
from relax_bus.log import get_logger
from schemas import WeightsAnnouncement
from workers.state_keys import WEIGHTS_BROADCAST
from workers.weights.object_store import ObjectStoreTransport
from workers.weights.serialization import SAFETENSORS_CODES, SAFETENSORS_DTYPES
from workers.weights.transport import StateDict

log = get_logger(__name__)
POLL_S = 0.02
"""How often a waiting reader looks for the next round (a store lookup on the loopback or the LAN)."""
BEAT_S = 0.5


def pack(state: StateDict, bucket_bytes: int) -> list[list[dict[str, Any]]]:
    """The bucket layout of `state`: per bucket, its tensors' name, dtype, shape, offset and size (offsets
    aligned to 64 bytes); tensors go in name order, a new bucket starts when the next one would overflow."""
    buckets: list[list[dict[str, Any]]] = [[]]
    at = 0
    for name in sorted(state):
        tensor = state[name]
        code = SAFETENSORS_CODES.get(tensor.dtype)
        if code is None:
            raise ValueError(f"weights: tensor {name} has dtype {tensor.dtype}, which the broadcast cannot carry")
        size = tensor.numel() * tensor.element_size()
        if buckets[-1] and at + size > bucket_bytes:
            buckets.append([])
            at = 0
        buckets[-1].append({"name": name, "dtype": code, "shape": list(tensor.shape), "offset": at, "size": size})
        at += size + (-size % 64)
    return [b for b in buckets if b]


def bucket_size(bucket: list[dict[str, Any]]) -> int:
    last = bucket[-1]
    return int(last["offset"] + last["size"])


def fill(bucket: list[dict[str, Any]], state: StateDict) -> torch.Tensor:
    """The bytes of one bucket on the CPU (a lone contiguous CPU tensor is sent as it is, without a copy)."""
    if len(bucket) == 1:
        return state[bucket[0]["name"]].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    buf = torch.empty(bucket_size(bucket), dtype=torch.uint8)
    for spec in bucket:
        if spec["size"]:
            tensor = state[spec["name"]].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            buf[spec["offset"] : spec["offset"] + spec["size"]].copy_(tensor)
    return buf


def unpack(bucket: list[dict[str, Any]], buf: torch.Tensor) -> StateDict:
    """The tensors of one received bucket, as views into it."""
    out: StateDict = {}
    for spec in bucket:
        raw = buf[spec["offset"] : spec["offset"] + spec["size"]]
        out[spec["name"]] = raw.view(SAFETENSORS_DTYPES[spec["dtype"]]).reshape(spec["shape"])
    return out


def sha256(buf: torch.Tensor) -> str:
    return hashlib.sha256(memoryview(buf.numpy())).hexdigest()


def group(store: dist.Store, epoch: int, rank: int, size: int, host: str, timeout_s: float) -> dist.ProcessGroup:
    """The gloo group of `epoch` (blocks until every rank has joined, or `timeout_s`)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore(f"pg/{epoch}", store), rank, size, options)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host` only (`port` 0: a free one), for the publisher's store.

    `TCPStore(host, port, is_master=True)` binds its own socket to every interface whatever `host` says; given
    this socket's descriptor (`master_listen_fd`) it serves on it instead, so a loopback run stays on the loopback.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(128)
    return sock


def device_host(host: str) -> str:
    """The address this process's gloo pairs listen on: the loopback for a loopback run, else this host's name."""
    return host if host in ("127.0.0.1", "localhost") else socket.gethostname()


class Sender:
    """The publisher's side: the store, the members it has seen beat, and the group of the current epoch."""

    def __init__(self, host: str, port: int, timeout_s: float, bucket_mb: int, verify: bool) -> None:
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.listener = listen(host, port)
        self.store = dist.TCPStore(
            host, self.listener.getsockname()[1], is_master=True, wait_for_workers=False, timeout=self.timeout,
            master_listen_fd=self.listener.fileno(),
        )  # fmt: skip
        self.address = {"host": host, "port": self.store.port, "started": time.time()}
        self.timeout_s, self.bucket_bytes, self.verify = timeout_s, bucket_mb << 20, verify
        self.device = device_host(host)
        self.beats: dict[int, tuple[int, float]] = {}  # ticket -> (last beat count, when it last moved)
        self.epoch, self.members, self.pg, self.broken = 0, [], None, False
        self.round = 0
        self.round_s: float | None = None
        """Seconds the last successful round took (its group's rendezvous included)."""

    def live_members(self) -> list[int]:
        now = time.monotonic()
        for ticket in range(1, self.store.add("joined", 0) + 1):
            count = self.store.add(f"beat/{ticket}", 0)
            seen = self.beats.get(ticket)
            if seen is None or seen[0] != count:
                self.beats[ticket] = (count, now)
        return [t for t, (_, moved) in sorted(self.beats.items()) if now - moved < self.timeout_s]

    def send(self, version: int, state: StateDict) -> int:
        """One round: the live members receive `version`; returns how many (0 when the round failed)."""
        members = self.live_members()
        if members != self.members or self.broken:
            self.epoch, self.members, self.pg, self.broken = self.epoch + 1, members, None, False
        layout = pack(state, self.bucket_bytes)
        meta: dict[str, Any] = {"version": version, "epoch": self.epoch, "members": members, "buckets": layout}
        # With `verify` every bucket is packed up front (its digest goes into the round), else one at a time.
        ready = [fill(bucket, state) for bucket in layout] if members and self.verify else None
        if ready is not None:
            meta["sha256"] = [sha256(buf) for buf in ready]
        self.round += 1
        self.store.set(f"round/{self.round}", json.dumps(meta))
        self.store.add("rounds", 1)
        if not members:
            return 0
        started = time.perf_counter()
        try:
            if self.pg is None:
                self.pg = group(self.store, self.epoch, 0, len(members) + 1, self.device, self.timeout_s)
            for i, bucket in enumerate(layout):
                self.pg.broadcast(ready[i] if ready is not None else fill(bucket, state), 0).wait()
        except RuntimeError as err:  # a member died or stalled: this version goes by the object store only
            self.broken = True
            log.warning("weights_broadcast_failed", version=version, members=len(members), error=str(err)[:300])
            return 0
        self.round_s = time.perf_counter() - started
        done = time.monotonic()
        for ticket in members:  # they were alive through the round, however long it took without beating
            self.beats[ticket] = (self.beats[ticket][0], done)
        mib = sum(bucket_size(bucket) for bucket in layout) / 2**20
        log.info("weights_broadcast", version=version, members=len(members), mib=round(mib, 2),
                 seconds=round(self.round_s, 3))  # fmt: skip
        return len(members)


class Receiver:
    """A reader's side: a thread that beats, follows the rounds and keeps the newest version it received."""

    def __init__(self, address: dict[str, Any], timeout_s: float) -> None:
        self.address, self.timeout_s = address, timeout_s
        self.device = device_host(address["host"])
        self.cond = threading.Condition()
        self.newest: tuple[int, StateDict] | None = None
        self.inflight: int | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="weights-broadcast", daemon=True)
        self.thread.start()
        atexit.register(self.close)  # a gloo group torn down under a running thread aborts the interpreter

    def take(self, version: int) -> StateDict | None:
        """The tensors of `version` if this reader received it (waiting for its round if one is running)."""
        with self.cond:
            self.cond.wait_for(lambda: self.inflight != version, timeout=self.timeout_s * 2)
            if self.newest is not None and self.newest[0] == version:
                return self.newest[1]
        return None

    def stop(self) -> None:
        self.stopped.set()

    def close(self) -> None:
        """Stop and wait for the thread (it polls every POLL_S; inside a round, at most `timeout_s` more)."""
        self.stopped.set()
        self.thread.join(timeout=self.timeout_s + 5)

    def _run(self) -> None:
        try:
            store = dist.TCPStore(
                self.address["host"], self.address["port"], is_master=False,
                timeout=datetime.timedelta(seconds=self.timeout_s),
            )  # fmt: skip
            ticket = store.add("joined", 1)
            log.info("weights_broadcast_joined", ticket=ticket, port=self.address["port"])
            self._follow(store, ticket)
        except Exception as err:  # the publisher is gone (the run's end, or a crash: a new one names a new store)
            if not self.stopped.is_set():
                log.info("weights_broadcast_left", error=str(err)[:300])
        finally:
            self.stopped.set()
            with self.cond:
                self.inflight = None
                self.cond.notify_all()

    def _follow(self, store: dist.Store, ticket: int) -> None:
        epoch, pg, beat = None, None, 0.0
        following = store.add("rounds", 0) + 1
        while not self.stopped.is_set():
            if time.monotonic() - beat > BEAT_S:
                store.add(f"beat/{ticket}", 1)
                beat = time.monotonic()
            if not store.check([f"round/{following}"]):
                time.sleep(POLL_S)
                continue
            meta = json.loads(store.get(f"round/{following}"))
            current = store.add("rounds", 0)
            following += 1
            if ticket not in meta["members"] or current >= following:  # not ours, or over already
                continue
            with self.cond:
                self.inflight = meta["version"]
            try:
                if meta["epoch"] != epoch:
                    epoch, pg = None, None
                    size = len(meta["members"]) + 1
                    pg = group(store, meta["epoch"], meta["members"].index(ticket) + 1, size, self.device,
                               self.timeout_s)  # fmt: skip
                    epoch = meta["epoch"]
                state = self._receive(pg, meta)
            except RuntimeError as err:
                epoch, pg = None, None
                log.warning("weights_broadcast_missed", version=meta["version"], error=str(err)[:300])
                state = None
            with self.cond:
                if state is not None:
                    self.newest = (meta["version"], state)
                self.inflight = None
                self.cond.notify_all()

    def _receive(self, pg: dist.ProcessGroup, meta: dict[str, Any]) -> StateDict:
        state: StateDict = {}
        for i, bucket in enumerate(meta["buckets"]):
            buf = torch.empty(bucket_size(bucket), dtype=torch.uint8)
            pg.broadcast(buf, 0).wait()
            if "sha256" in meta and sha256(buf) != meta["sha256"][i]:
                raise RuntimeError(f"bucket {i} of v{meta['version']} differs from the sha256 its publisher sent")
            state.update(unpack(bucket, buf))
        return state


class BroadcastTransport:
    """Weights by gloo broadcast to the readers that joined, and by the object store to everyone (module doc)."""

    def __init__(self, bus: Bus, cfg: Any) -> None:
        self.bus, self.cfg = bus, cfg
        self.fallback = ObjectStoreTransport(bus)
        self.sender: Sender | None = None
        self.receiver: Receiver | None = None
        self.received = 0
        """Versions this reader got by broadcast (the rest came from the object store)."""

    async def publish(self, version: int, state: StateDict, step: int) -> WeightsAnnouncement:
        if self.sender is None:
            cfg = self.cfg
            sender = await asyncio.to_thread(Sender, cfg.host, cfg.port, cfg.timeout_s, cfg.bucket_mb, cfg.verify)
            value = json.dumps(sender.address).encode()
            await self.bus.run_state.put(WEIGHTS_BROADCAST, value)
            self.sender = sender
        sender = self.sender
        _, announcement = await asyncio.gather(
            asyncio.to_thread(sender.send, version, state), self.fallback.publish(version, state, step)
        )
        return announcement.model_copy(update={"transport": "broadcast"})

    async def read(self, version: int) -> StateDict:
        receiver = await self._join() if version > 0 else None  # v0 alone (reference, a restart): no need to join
        if receiver is not None:
            state = await asyncio.to_thread(receiver.take, version)
            if state is not None:
                self.received += 1
                log.info("weights_broadcast_received", version=version)
                return state
        return await self.fallback.read(version)

    async def expect(self, version: int) -> None:
        """Nothing to start early: a member gets the version in its round, and following the object store's
        upload as well would download every version twice."""

    def close(self) -> None:
        """Leave the rounds (a reader) and drop the store (a publisher): readers first, then their publisher."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        self.sender = None

    async def _join(self) -> Receiver | None:
        """This reader's receiver for the publisher the KV names now (a new one after the trainer restarted)."""
        value = await self.bus.run_state.get(WEIGHTS_BROADCAST)
        if value is None:  # no publisher yet: the object store serves
            return None
        address = json.loads(value or b"{}")
        if self.receiver is not None and (self.receiver.address != address or self.receiver.stopped.is_set()):
            self.receiver.stop()
            self.receiver = None
        if self.receiver is None and self.sender is None:
            self.receiver = Receiver(address, self.cfg.timeout_s)
        return self.receiver

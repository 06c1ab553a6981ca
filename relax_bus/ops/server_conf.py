"""The nats-server configuration `relax auth` writes: listener, payload and JetStream limits, routes.

One account per run holds the run's users (`relax_bus.ops.credentials`), with JetStream limits that bound
what the run may store: a role whose credentials leak can fill neither the server's disk nor its memory,
nor create streams and consumers without end. The server's own JetStream limits are the same numbers.
Every limit is finite: where a store of the run has no byte bound of its own (the weights store while
`bus.weights_max_bytes` is null), the account allows it `UNBOUNDED_STORE_ALLOWANCE` on top of the run's
bounds, unless `--max-file-store` / `--max-memory-store` say otherwise.
Monitoring (HTTP, unauthenticated) is off unless asked for, and then listens on 127.0.0.1 only.

A cluster's routes (`cluster.conf`) carry a route user and password: a server that does not present
them cannot join, read every account's traffic or take JetStream replicas.

`describe_server_conf` reads back the few lines `relax server --auth` needs from a written config.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from relax_bus.errors import ConfigError
from relax_bus.topology import Topology

DEFAULT_MAX_PAYLOAD = 1 << 20
"""Largest message the server accepts (nats-server's own default, stated explicitly), unless the run's
largest message (`bus.max_msg_bytes`) needs more."""
FILE_HEADROOM = 1 << 30
"""File storage above the run's byte bounds (streams, KV buckets and object stores): slack."""
MEMORY_HEADROOM = 1 << 30
"""Memory storage above the run's byte bounds."""
UNBOUNDED_STORE_ALLOWANCE = 64 << 30
"""Storage the account adds for a store without a byte bound of its own (the weights store with
`bus.weights_max_bytes` null: the trainer's retention bounds it, ~14 GB for a 135M-parameter model at the
defaults): a finite ceiling, so that the trainer's credentials cannot fill the server's disk either."""
DEFAULT_MAX_STREAMS = 32
"""Streams of the run's account; a run declares 11 (6 streams, 2 KV buckets, 3 object stores)."""
DEFAULT_MAX_CONSUMERS = 1024
"""Consumers of the run's account: its durables, and whatever the admin creates (no role user may create one);
each stream, bucket and store accepts `bus.max_consumers` (64) of them, so no one of them can take them all."""
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class JetStreamLimits:
    """What the run's account may hold on one server (bytes, and counts)."""

    max_memory: int
    max_file: int
    max_streams: int = DEFAULT_MAX_STREAMS
    max_consumers: int = DEFAULT_MAX_CONSUMERS

    @classmethod
    def for_run(
        cls,
        topology: Topology,
        *,
        max_memory: int | None = None,
        max_file: int | None = None,
        max_streams: int = DEFAULT_MAX_STREAMS,
        max_consumers: int = DEFAULT_MAX_CONSUMERS,
    ) -> JetStreamLimits:
        """Limits that fit the run: by default its byte bounds (`reservations`) plus a headroom; explicit
        values below those bounds are refused (`relax init` would fail on them)."""
        reserved, open_ended = reservations(topology), unbounded(topology)
        limits = cls(
            max_memory=max_memory if max_memory is not None else _default(reserved, open_ended, "memory"),
            max_file=max_file if max_file is not None else _default(reserved, open_ended, "file"),
            max_streams=max_streams,
            max_consumers=max_consumers,
        )
        problems = [
            f"--max-{kind}-store {have} is below the {reserved[kind]} bytes ({size_text(reserved[kind])}) the run's "
            f"streams and stores reserve ({kind} storage): raise it, or lower their bus.*_max_bytes"
            for kind, have in (("memory", limits.max_memory), ("file", limits.max_file))
            if 0 <= have < reserved[kind]
        ]
        declared = len(topology.streams) + len(topology.buckets) + len(topology.object_stores)
        if limits.max_streams < declared:
            problems.append(f"--max-streams {limits.max_streams} is below the {declared} streams the run declares")
        per_stream = max(s.max_consumers for s in topology.streams)
        if limits.max_consumers < max(len(topology.consumers), per_stream):
            problems.append(
                f"--max-consumers {limits.max_consumers} is below the {per_stream} each stream of the run accepts "
                "(bus.max_consumers): raise it, or lower that"
            )
        if problems:
            raise ConfigError("JetStream limits", problems)
        return limits


@dataclass(frozen=True)
class Cluster:
    """Where a server listens for routes and which servers it dials; `relax auth` adds the credentials."""

    routes: tuple[str, ...]
    """host:port of the cluster's route listeners; a server's route to itself is dropped by nats-server,
    so every server can share one list."""
    name: str = "relax"
    listen: str = "0.0.0.0:6222"


@dataclass(frozen=True)
class ServerConfInfo:
    """What `relax server --auth` reads back from a written nats-server.conf."""

    host: str
    port: int
    store_dir: Path | None
    tls: bool

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"


def q(text: str | Path) -> str:
    """A double-quoted string in nats-server's config syntax (quoted, so `$` is no variable)."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or name) is this machine only: 127.0.0.0/8, ::1 or localhost."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_host_port(address: str, what: str, source: str = "relax auth flags") -> tuple[str, int]:
    """`host:port` (IPv6 as `[::1]:port`) as a pair; ConfigError naming `what` otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(source, [f"{what} {address!r} is not HOST:PORT"])
    return host.strip("[]"), int(port)


def parse_size(text: str) -> int:
    """Bytes from `123`, `512M`, `32G`, `1TiB` (powers of 1024); ValueError otherwise."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (bytes, or a number with K, M, G or T)")
    return int(m.group(1)) << (10 * " KMGT".index((m.group(2) or " ").upper()))


def size_text(n: int) -> str:
    """Bytes as the largest whole unit: 2952790016 -> '2.75 GiB'."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} B"


def reservations(topology: Topology) -> dict[str, int]:
    """Bytes the run's byte bounds (streams and object stores) reserve per storage kind, replicas counted,
    as clustered JetStream counts them against an account."""
    reserved = {"file": 0, "memory": 0}
    for s in topology.streams:
        if s.max_bytes > 0:
            reserved[s.storage] += s.max_bytes * s.replicas
    storage, replicas = topology.streams[0].storage, topology.streams[0].replicas  # buckets and stores: the run's
    for b in topology.buckets:
        if b.max_bytes > 0:
            reserved[storage] += b.max_bytes * replicas
    for o in topology.object_stores:
        if o.max_bytes > 0:
            reserved[storage] += o.max_bytes * replicas
    return reserved


def unbounded(topology: Topology) -> set[str]:
    """Storage kinds holding a stream or object store without a byte bound (the weights store by default:
    `bus.weights_max_bytes` null, bounded by the trainer's retention instead)."""
    storage = topology.streams[0].storage
    kinds = {s.storage for s in topology.streams if s.max_bytes <= 0}
    return kinds | {storage for o in topology.object_stores if o.max_bytes <= 0}


def _default(reserved: dict[str, int], open_ended: set[str], kind: str) -> int:
    """The account's default bound of one storage kind: the run's bounds plus headroom, plus
    `UNBOUNDED_STORE_ALLOWANCE` when a stream or store of that kind has no bound of its own. Always finite."""
    allowance = UNBOUNDED_STORE_ALLOWANCE if kind in open_ended else 0
    return reserved[kind] + allowance + (FILE_HEADROOM if kind == "file" else MEMORY_HEADROOM)


def check_payload(max_payload: int, largest_message: int) -> None:
    """The server must accept the run's largest message (`bus.msg_bytes_limit`, headers included)."""
    if max_payload < largest_message:
        raise ConfigError(
            "relax auth flags",
            [
                f"--max-payload {max_payload} is below the run's largest message, {largest_message} bytes "
                "(bus.max_msg_bytes; by default bus.claim_check_bytes + 64 KiB): raise it, or lower those"
            ],
        )


def account_jetstream(limits: JetStreamLimits) -> str:
    """The `jetstream` block of the run's account."""
    return (
        f"jetstream: {{ max_memory: {limits.max_memory}, max_file: {limits.max_file}, "
        f"max_streams: {limits.max_streams}, max_consumers: {limits.max_consumers} }}"
    )


def server_conf(
    host: str,
    port: int,
    store_dir: Path | None,
    tls: tuple[Path, Path] | None,
    *,
    limits: JetStreamLimits | None = None,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    monitor_port: int | None = None,
    cluster: bool = False,
) -> str:
    """A runnable nats-server config: JetStream with limits, the users of auth.conf (and cluster.conf).

    Without `store_dir` the store comes from the server's `-sd` flag (or its default).
    """
    js = [f"store_dir: {q(store_dir)}"] if store_dir else []
    if limits is not None:
        # Always finite from `JetStreamLimits.for_run`; a -1 (none) given by hand is left to the server's default.
        js += [f"{key}: {value}" for key, value in (("max_memory_store", limits.max_memory),
                                                     ("max_file_store", limits.max_file)) if value >= 0]  # fmt: skip
    lines = [
        "# nats-server -c nats-server.conf   (written by `relax auth`)",
        f"listen: {q(f'{host}:{port}')}",
        f"max_payload: {max_payload}",
        f"jetstream {{ {', '.join(js)} }}" if js else "jetstream: enabled",
    ]
    if monitor_port:
        lines.append(f"http: {q(f'127.0.0.1:{monitor_port}')}  # monitoring: no authentication, loopback only")
    else:
        lines.append("# no `http`: monitoring is off (relax auth --monitor-port turns it on, on 127.0.0.1)")
    if tls is not None:
        lines.append(f"tls {{ cert_file: {q(tls[0])}, key_file: {q(tls[1])} }}")
    if cluster:
        lines.append("include ./cluster.conf")
    return "\n".join([*lines, "include ./auth.conf", ""])


def cluster_conf(cluster: Cluster, user: str, password: str, *, server_name: str | None = None) -> str:
    """A `cluster` block whose routes need `user`/`password`, and that dials the others with them.

    Usable alone (`nats-server -c cluster.conf -js ...`, clients not authenticated) or included by
    nats-server.conf. It holds the route password in clear (the dialling side must send it): mode 0600.
    """
    routes = "".join(f"    {q(f'nats-route://{user}:{password}@{r}')}\n" for r in cluster.routes)
    name = f"server_name: {q(server_name)}\n" if server_name else ""
    return (
        "# Routes of the cluster, written by `relax auth`: a server without this password cannot join.\n"
        f"{name}cluster {{\n  name: {q(cluster.name)}\n  listen: {q(cluster.listen)}\n"
        f"  authorization {{ user: {q(user)}, password: {q(password)} }}\n"
        f"  routes: [\n{routes}  ]\n}}\n"
    )


def describe_server_conf(path: Path) -> ServerConfInfo:
    """Listener, store and TLS of a nats-server.conf written by `relax auth`; ConfigError naming the file."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError("relax server --auth", [f"{path}: {err.strerror} (write it with `relax auth`)"]) from None
    listen = re.search(r'^listen:\s*"([^"]+)"', text, re.MULTILINE)
    if listen is None:
        raise ConfigError("relax server --auth", [f"{path} has no `listen` line: was it written by `relax auth`?"])
    host, port = split_host_port(listen.group(1), f"listen in {path}", "relax server --auth")
    store = re.search(r'^jetstream \{[^}\n]*store_dir:\s*"([^"]+)"', text, re.MULTILINE)
    return ServerConfInfo(host, port, Path(store.group(1)) if store else None, bool(re.search(r"^tls ", text, re.M)))

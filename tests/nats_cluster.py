"""A three-server JetStream cluster as local processes on loopback ports (routes between them).

With `route_auth` (user, password) the route listeners require those credentials and each server
dials the others with them: the configs come from `relax_bus.ops.server_conf.cluster_conf`, as
`relax auth --cluster-routes` writes them.
"""

from __future__ import annotations

import time
from pathlib import Path

from relax_bus.ops.server import EmbeddedServer, free_port
from relax_bus.ops.server_conf import Cluster, cluster_conf

CLUSTER_NAME = "relax"


class NatsCluster:
    """`size` nats-servers that form one JetStream cluster; each is an `EmbeddedServer` (stop/kill by PID)."""

    def __init__(self, root: Path, size: int = 3, route_auth: tuple[str, str] | None = None) -> None:
        self.root = root
        self.routes = [free_port() for _ in range(size)]
        self.servers: dict[str, EmbeddedServer] = {}
        root.mkdir(parents=True, exist_ok=True)
        for i, route in enumerate(self.routes):
            name = f"n{i + 1}"
            conf = root / f"{name}.conf"
            if route_auth is not None:
                peers = tuple(f"127.0.0.1:{p}" for p in self.routes if p != route)
                cluster = Cluster(peers, CLUSTER_NAME, f"127.0.0.1:{route}")
                conf.write_text(cluster_conf(cluster, *route_auth, server_name=name))
            else:
                others = ", ".join(f"nats-route://127.0.0.1:{p}" for p in self.routes if p != route)
                conf.write_text(
                    f"server_name: {name}\n"
                    f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: 127.0.0.1:{route}\n  routes: [{others}]\n}}\n"
                )
            self.servers[name] = EmbeddedServer(store_dir=root / name, config_file=conf)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers.values()]

    @property
    def url(self) -> str:
        """All client URLs, comma-separated (as `--nats-url` takes them)."""
        return ",".join(self.urls)

    def start(self, timeout_s: float = 30.0) -> NatsCluster:
        for server in self.servers.values():
            server.start(timeout_s)
        self._wait_routes(timeout_s)
        return self

    def _wait_routes(self, timeout_s: float) -> None:
        """Wait until every server logged its routes to the others (JetStream then elects a meta leader)."""
        deadline = time.monotonic() + timeout_s
        want = len(self.servers) - 1
        for server in self.servers.values():
            while server.log_file.read_text(errors="replace").count("Route connection created") < want:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cluster routes not up in {timeout_s:g}s:\n{server.log_tail(20)}")
                time.sleep(0.1)

    def cleanup(self) -> None:
        for server in self.servers.values():
            server.cleanup()

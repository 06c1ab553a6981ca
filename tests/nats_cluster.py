"""A three-server JetStream cluster as local processes on loopback ports (routes between them)."""

from __future__ import annotations

import time
from pathlib import Path

from relax_bus.server import EmbeddedServer, free_port

CLUSTER_NAME = "relax"


class NatsCluster:
    """`size` nats-servers that form one JetStream cluster; each is an `EmbeddedServer` (stop/kill by PID)."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.root = root
        self.routes = [free_port() for _ in range(size)]
        self.servers: dict[str, EmbeddedServer] = {}
        for i, route in enumerate(self.routes):
            name = f"n{i + 1}"
            others = ", ".join(f"nats-route://127.0.0.1:{p}" for p in self.routes if p != route)
            conf = root / f"{name}.conf"
            root.mkdir(parents=True, exist_ok=True)
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

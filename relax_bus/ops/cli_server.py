"""The commands that make a server's files and run it: `relax auth` (one least-privilege NATS user per
role of a run, the server config and its limits) and `relax server` (an embedded nats-server, with those
users or on loopback only). Heavy modules are imported per command, as in `relax_bus.ops.cli`."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_bus.settings import RunConfig


def auth_command(args: argparse.Namespace, config_model: type[RunConfig]) -> int:
    from pathlib import Path

    from relax_bus.errors import ConfigError
    from relax_bus.ops.arguments import config_with_overrides
    from relax_bus.ops.credentials import check_exposure, write_bundle
    from relax_bus.ops.server_conf import Cluster, JetStreamLimits
    from relax_bus.topology import build_topology

    config = config_with_overrides(args, config_model)  # `run=ID`: a config whose run id is set elsewhere
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("relax auth flags", ["--tls-cert and --tls-key must be given together"])
    tls = (Path(args.tls_cert), Path(args.tls_key)) if args.tls_cert else None
    cluster = None
    if args.cluster_routes:
        routes = tuple(r.strip() for r in args.cluster_routes.split(",") if r.strip())
        cluster = Cluster(routes, args.cluster_name, args.cluster_listen or f"{args.host}:6222")
    for warning in check_exposure(args.host, tls, cluster, args.allow_plaintext, args.nkeys):
        print(f"relax: warning: {warning}", file=sys.stderr)
    limits = JetStreamLimits.for_run(
        build_topology(config),
        max_memory=args.max_memory_store,
        max_file=args.max_file_store,
        max_streams=args.max_streams,
        max_consumers=args.max_consumers,
    )
    out = Path(args.out)
    bundle = write_bundle(
        config,
        out,
        host=args.host,
        port=args.port,
        store_dir=Path(args.store_dir),
        tls=tls,
        tls_ca_file=Path(args.tls_ca) if args.tls_ca else None,
        force=args.force,
        allow_plaintext=args.allow_plaintext,
        nkeys=args.nkeys,
        client_url=args.client_url,
        role_dirs=args.role_dirs,
        limits=limits,
        max_payload=args.max_payload,
        monitor_port=args.monitor_port,
        cluster=cluster,
    )
    login = "nkey seeds (.nk)" if args.nkeys else "auth.conf holds bcrypt hashes"
    print(f"run {config.run}: {len(bundle.credentials)} NATS users written to {out} ({login})")
    print(f"  {bundle.server_conf}  start it: relax server --auth {out}  (or nats-server -c {bundle.server_conf})")
    print(f"  {bundle.auth_conf}  the run's account: users, permissions, JetStream limits")
    if bundle.cluster_conf:
        print(f"  {bundle.cluster_conf}  route password and routes of cluster {args.cluster_name}")
    for role, path in bundle.env_files.items():
        seed = f", seed {bundle.seed_files[role].name}" if role in bundle.seed_files else ""
        print(f"  {path}  user {bundle.credentials[role].user}{seed} (mode 0600)")
    role = next(r.name for r in config.chain if r.input is not None)  # the first role that consumes a hop
    example = bundle.env_files.get(role, out / f"{role}.env")
    print(f"run a role with its file: (set -a; . {example}; relax worker {role} --run {config.run})")
    return 0


def server_command(args: argparse.Namespace, config_model: type[RunConfig]) -> int:
    import signal
    import threading
    from pathlib import Path

    from relax_bus.errors import ConfigError
    from relax_bus.ops.arguments import connection_settings
    from relax_bus.ops.server import EmbeddedServer, free_port
    from relax_bus.ops.server_conf import describe_server_conf, is_loopback

    config_file, store_dir, url = None, args.store_dir, None
    if args.auth:
        if args.host is not None or args.port is not None or args.monitor_port is not None:
            raise ConfigError(
                "relax server flags",
                [
                    "with --auth the bundle says where the server listens: give --host, "
                    "--port and --monitor-port to `relax auth` instead"
                ],
            )
        config_file = Path(args.auth) / "nats-server.conf"
        conf = describe_server_conf(config_file)
        host, port, url = conf.host, conf.port, conf.url
        store_dir = store_dir or conf.store_dir
    else:
        host, port = args.host or "127.0.0.1", args.port if args.port is not None else 4222
        if not is_loopback(host) and not args.allow_unauthenticated:
            raise ConfigError(
                "relax server flags",
                [
                    f"--host {host} without --auth would let anyone who reaches it read and "
                    "write every run: write users with `relax auth` and pass --auth DIR, or "
                    "--allow-unauthenticated"
                ],
            )
    server = EmbeddedServer(
        port=port or free_port(host),
        host=host,
        store_dir=store_dir or "./.relax/nats",
        binary=args.nats_server_bin or connection_settings(args).nats_server_bin,
        monitor_port=args.monitor_port,
        config_file=config_file,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server.start()
    users = f", users of {args.auth}" if args.auth else ", no authentication"
    print(
        f"nats-server {url or server.url} (pid {server.pid}, JetStream store {server.store_dir}{users}); "
        "Ctrl-C stops it",
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            if server.proc is not None and server.proc.poll() is not None:
                print(
                    f"relax: error: nats-server exited with code {server.proc.returncode}:\n{server.log_tail()}",
                    file=sys.stderr,
                )
                return 1
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0

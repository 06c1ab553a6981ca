"""The `relax` command. Arguments are parsed first; heavy modules are imported per command after."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relax", description="Relax-bus: asynchronous RL post-training over NATS JetStream."
    )
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_nats(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument(
            "--nats-url",
            help="NATS server URL(s), comma-separated (default: $RELAX_NATS_URL or nats://127.0.0.1:4222)",
        )
        return sp

    s = sub.add_parser("server", help="run an embedded nats-server with JetStream until interrupted")
    s.add_argument("--port", type=int, default=4222, help="client port (0 picks a free one; default 4222)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--store-dir", default="./.relax/nats", help="JetStream file store (default ./.relax/nats)")
    s.add_argument("--monitor-port", type=int, help="HTTP monitoring port (off by default)")
    s.add_argument("--nats-server-bin", help="path of the nats-server binary (default: found automatically)")

    i = with_nats(sub.add_parser("init", help="create or update a run's streams, consumers and stores from CONFIG"))
    i.add_argument("config", help="run config (YAML or JSON)")
    i.add_argument("--json", action="store_true", help="print the result as JSON")
    i.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep retrying this long while NATS or JetStream is not up yet (a server or cluster just started)",
    )

    n = with_nats(sub.add_parser("inspect", help="show a run: streams, consumers, state, live workers, dead letters"))
    n.add_argument("run", help="run id")
    n.add_argument("--json", action="store_true", help="print the result as JSON")

    w = with_nats(sub.add_parser("worker", help="run one role of an initialised run (its config comes from KV)"))
    w.add_argument("role", choices=ROLES, help="the role to run")
    w.add_argument("--run", "--run-id", dest="run", required=True, help="run id")
    w.add_argument("--work-dir", default="./.relax/work", help="local cache for model files (default ./.relax/work)")
    w.add_argument("--threads", type=int, default=1, help="torch threads of this process (default 1)")
    w.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default=argparse.SUPPRESS,
        help="log level (also accepted before the command)",
    )

    a = sub.add_parser("auth", help="write a nats-server config with one least-privilege user per role of CONFIG's run")
    a.add_argument("config", help="run config (YAML or JSON)")
    a.add_argument("--out", required=True, help="directory for nats-server.conf, auth.conf and <role>.env files")
    a.add_argument("--host", default="127.0.0.1", help="address the server listens on (default 127.0.0.1)")
    a.add_argument("--port", type=int, default=4222, help="client port (default 4222)")
    a.add_argument("--store-dir", default="./.relax/nats", help="JetStream file store (default ./.relax/nats)")
    a.add_argument("--tls-cert", help="server certificate: the server then requires TLS")
    a.add_argument("--tls-key", help="server private key (with --tls-cert)")
    a.add_argument("--tls-ca", help="CA that signed the certificate, written into the credentials files")
    a.add_argument("--force", action="store_true", help="replace credentials written before")

    y = with_nats(sub.add_parser("replay", help="recompute one step of a run from its checkpoint and compare the loss"))
    y.add_argument("run", help="run id")
    y.add_argument("--step", type=int, required=True, help="the step to recompute")
    y.add_argument("--work-dir", default="./.relax/work", help="local cache for model files (default ./.relax/work)")
    y.add_argument("--json", action="store_true", help="print the result as JSON")

    r = sub.add_parser("run", help="run a whole training run locally: NATS, every role, progress, reward curve")
    r.add_argument("config", help="run config (YAML or JSON)")
    r.add_argument("--nats-url", help="use this NATS server instead of starting an embedded one")
    r.add_argument("--run-dir", help="where metrics, curve, logs and the NATS store go (default runs/<run>)")
    r.add_argument("--steps", type=int, help="override trainer.steps")
    r.add_argument("--run-id", help="override the config's run id")
    return p


# Roles and the modules that run them: imported only by the command that needs them.
ROLES = ("feeder", "rollout", "reward", "reference", "actor")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from relax_bus import log
    from relax_bus.errors import RelaxBusError

    log.configure(args.log_level)
    try:
        if args.command == "server":
            return _server(args)
        if args.command == "auth":
            return _auth(args)
        return asyncio.run(_COMMANDS[args.command](args))
    except RelaxBusError as err:
        print(f"relax: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _settings(args: argparse.Namespace) -> Any:
    from pydantic import ValidationError

    from relax_bus.errors import ConfigError
    from relax_bus.settings import ConnectionSettings, validation_problems

    try:
        overrides = {"nats_url": args.nats_url} if getattr(args, "nats_url", None) else {}
        return ConnectionSettings(**overrides)
    except ValidationError as err:
        raise ConfigError("connection settings (flags / RELAX_* environment)", validation_problems(err)) from None


async def _init(args: argparse.Namespace) -> int:
    from relax_bus.connection import connect
    from relax_bus.provision import provision_when_ready
    from relax_bus.settings import load_run_config

    config = load_run_config(args.config)
    started = time.monotonic()
    nc = await connect(_settings(args), name="relax-init", retry_for_s=args.wait)
    try:
        wait_left = max(0.0, args.wait - (time.monotonic() - started))
        report = await provision_when_ready(nc.jetstream(timeout=10.0), config, wait_left)
    finally:
        await nc.close()
    if args.json:
        print(json.dumps({"run": config.run, **vars(report)}, indent=2))
    else:
        print(
            f"run {config.run}: {len(report.created)} created, {len(report.updated)} updated, "
            f"{len(report.unchanged)} unchanged"
        )
        for what in ("created", "updated"):
            for name in getattr(report, what):
                print(f"  {what:8} {name}")
    return 0


async def _inspect(args: argparse.Namespace) -> int:
    from relax_bus.connection import connect
    from relax_bus.inspect import gather, render

    nc = await connect(_settings(args), name="relax-inspect")
    try:
        info = await gather(nc.jetstream(timeout=10.0), args.run)
    finally:
        await nc.close()
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


def _auth(args: argparse.Namespace) -> int:
    from pathlib import Path

    from relax_bus.credentials import write_bundle
    from relax_bus.errors import ConfigError
    from relax_bus.settings import load_run_config

    config = load_run_config(args.config)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("relax auth flags", ["--tls-cert and --tls-key must be given together"])
    out = Path(args.out)
    bundle = write_bundle(
        config,
        out,
        host=args.host,
        port=args.port,
        store_dir=Path(args.store_dir),
        tls=(Path(args.tls_cert), Path(args.tls_key)) if args.tls_cert else None,
        tls_ca_file=Path(args.tls_ca) if args.tls_ca else None,
        force=args.force,
    )
    stored = "bcrypt hashes" if bundle.hashed else "plain text (no bcrypt in this C library: keep it private)"
    print(f"run {config.run}: {len(bundle.credentials)} NATS users written to {out} (auth.conf holds {stored})")
    print(f"  {bundle.server_conf}  start it: nats-server -c {bundle.server_conf}")
    print(f"  {bundle.auth_conf}  users and permissions (include it in another server config)")
    for role, path in bundle.env_files.items():
        print(f"  {path}  user {bundle.credentials[role].user} (mode 0600)")
    print(f"run a role with its file: (set -a; . {out / 'rollout.env'}; relax worker rollout --run {config.run})")
    return 0


def _server(args: argparse.Namespace) -> int:
    import signal
    import threading

    from relax_bus.server import EmbeddedServer, free_port

    server = EmbeddedServer(
        port=args.port or free_port(args.host),
        host=args.host,
        store_dir=args.store_dir,
        binary=args.nats_server_bin or _settings(args).nats_server_bin,
        monitor_port=args.monitor_port,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server.start()
    print(
        f"nats-server {server.url} (pid {server.pid}, JetStream store {server.store_dir}); Ctrl-C stops it",
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


async def _worker(args: argparse.Namespace) -> int:
    from pathlib import Path

    roles = importlib.import_module("workers.roles")
    code: int = await roles.run_role(args.role, _settings(args), args.run, Path(args.work_dir), args.threads)
    return code


async def _replay(args: argparse.Namespace) -> int:
    from pathlib import Path

    from relax_bus.bus import Bus

    replay = importlib.import_module("workers.replay")
    async with await Bus.connect(_settings(args), args.run, name="relax-replay") as bus:
        result = await replay.replay(bus, args.step, Path(args.work_dir))
    print(json.dumps(result.as_dict(), indent=2) if args.json else replay.render(result))
    return 0 if result.matches() else 1


async def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from relax_bus.settings import load_run_config

    overrides: dict[str, Any] = {}
    if args.run_id:
        overrides["run"] = args.run_id
    config = load_run_config(args.config, overrides)
    if args.steps:
        config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"steps": args.steps})})
    launcher = importlib.import_module("workers.launcher")
    run_dir = Path(args.run_dir or f"runs/{config.run}")
    summary = await launcher.launch(config, run_dir, args.nats_url, sys.stdout)
    print(
        f"\nrun {summary['run']}: {summary['steps']} steps in {summary['wall_s']}s, "
        f"reward {summary['reward_start']} -> {summary['reward_end']}"
    )
    print(f"metrics: {summary['metrics']}")
    print(f"reward curve: {summary['curve']}")
    return 0


_COMMANDS = {"init": _init, "inspect": _inspect, "worker": _worker, "replay": _replay, "run": _run}

if __name__ == "__main__":
    sys.exit(main())

"""The bus's commands: `server`, `init`, `inspect`, `auth`, `decode`, `probe` (`server` and `auth` in
`relax_bus.ops.cli_server`; the flags and helpers commands share in `relax_bus.ops.arguments`). Arguments are
parsed first; heavy modules are imported per command after.

The `relax` console command, defined by the roles' package, adds the role and training commands
(`worker`, `run`, `replay`, `config`) and names the run config model (the pipeline's), so this
package never imports the roles. `python -m relax_bus.ops.cli` is the bus alone, for runs whose config
has only bus sections.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_bus.ops.arguments import (
    CONFIG_HELP,
    LOG_LEVELS,
    Command,
    NoAbbrevParser,
    config_with_overrides,
    connection_settings,
    size,
    with_nats,
    with_overrides,
)
from relax_bus.ops.cli_server import auth_command, server_command
from relax_bus.probe import KINDS, probe

if TYPE_CHECKING:
    from relax_bus.settings import RunConfig


class _VersionAction(argparse.Action):
    """`--version`: the package's and nats-server's versions, looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        from relax_bus.ops.about import version_text

        print(version_text())
        parser.exit()


def build_parser() -> tuple[argparse.ArgumentParser, Any]:
    """The parser with the bus's subcommands, and its subparsers (to add more to)."""
    p = NoAbbrevParser(
        prog="relax", description="Relax-bus: asynchronous RL post-training over NATS JetStream.", allow_abbrev=False
    )
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    p.add_argument("--version", action=_VersionAction, help="print the version and the pinned nats-server's, and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("server", help="run an embedded nats-server with JetStream until interrupted")
    s.add_argument("--port", type=int, help="client port (0 picks a free one; default 4222)")
    s.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--store-dir", help="JetStream file store (default: the bundle's, else ./.relax/nats)")
    s.add_argument("--monitor-port", type=int, help="HTTP monitoring port (off by default; no authentication)")
    s.add_argument("--nats-server-bin", help="path of the nats-server binary (default: found automatically)")
    s.add_argument(
        "--auth",
        metavar="DIR",
        help="run DIR/nats-server.conf, written by `relax auth`: its users, limits, listener and TLS",
    )
    s.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="listen beyond loopback without --auth (anyone who reaches the port may read and write every run)",
    )

    i = with_nats(sub.add_parser("init", help="create or update a run's streams, consumers and stores from CONFIG"))
    i.add_argument(
        "config",
        help=CONFIG_HELP,
    )
    with_overrides(i)
    i.add_argument("--json", action="store_true", help="print the result as JSON")
    i.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep retrying this long while NATS or JetStream is not up yet (a server or cluster just started)",
    )
    i.add_argument(
        "--no-check",
        action="store_true",
        help="skip the pre-start check of the model, task, rewards and engine (for an init that cannot see the "
        "roles' files: each role still checks its part when it starts)",
    )

    n = with_nats(sub.add_parser("inspect", help="show a run: streams, consumers, state, live workers, dead letters"))
    n.add_argument("run", help="run id")
    n.add_argument("--json", action="store_true", help="print the result as JSON")

    pr = sub.add_parser(
        "probe",
        help="a container probe: exit 0 when this container's worker is ready (beating) or live (its loop runs)",
    )
    pr.add_argument("kind", choices=KINDS, help="ready: its heartbeat is stored; live: its heartbeat loop runs")
    pr.add_argument(
        "--heartbeat-file",
        type=Path,
        required=True,
        help="the file the worker was started with (`relax worker ... --heartbeat-file`)",
    )

    d = sub.add_parser(
        "decode",
        help="print a message body (msgpack, on stdin) as JSON: nats stream get STREAM SEQ --translate 'relax decode'",
    )
    d.add_argument(
        "--lines",
        action="store_true",
        help="one message per input line (a base64 body or `nats stream get --json` output), one JSON line each",
    )
    d.add_argument("--compact", action="store_true", help="one line of JSON instead of an indented block")

    a = sub.add_parser("auth", help="write a nats-server config with one least-privilege user per role of CONFIG's run")
    a.add_argument(
        "config",
        help=CONFIG_HELP,
    )
    with_overrides(a)
    a.add_argument("--out", required=True, help="directory for nats-server.conf, auth.conf and <role>.env files")
    a.add_argument("--host", default="127.0.0.1", help="address the server listens on (default 127.0.0.1)")
    a.add_argument("--port", type=int, default=4222, help="client port (default 4222)")
    a.add_argument("--store-dir", default="./.relax/nats", help="JetStream file store (default ./.relax/nats)")
    a.add_argument("--tls-cert", help="server certificate: the server then requires TLS")
    a.add_argument("--tls-key", help="server private key (with --tls-cert)")
    a.add_argument("--tls-ca", help="CA that signed the certificate, written into the credentials files")
    a.add_argument("--force", action="store_true", help="replace credentials written before")
    a.add_argument(
        "--allow-plaintext",
        action="store_true",
        help="allow a --host (or --cluster-listen) beyond loopback without TLS: a private network only",
    )
    a.add_argument(
        "--nkeys",
        action="store_true",
        help="log in with nkeys instead of passwords: a <role>.nk seed per role, no secret on the wire",
    )
    a.add_argument("--client-url", help="URL(s) the .env files give the roles (default: from --host and --port)")
    a.add_argument(
        "--role-dirs", action="store_true", help="put each role's files into DIR/<role>/ (one directory to hand over)"
    )
    lim = a.add_argument_group("server limits (a role's leaked credentials cannot exhaust the server)")
    lim.add_argument(
        "--max-payload", type=size, help="largest message (default 1M, or the run's bus.max_msg_bytes if more)"
    )
    lim.add_argument(
        "--max-file-store",
        type=size,
        help="JetStream file storage of the run (default: its byte bounds + 1G, + 64G if a store has none)",
    )
    lim.add_argument(
        "--max-memory-store", type=size, help="JetStream memory storage of the run (default: its byte bounds + 1G)"
    )
    lim.add_argument("--max-streams", type=int, default=32, help="streams of the run's account (default 32)")
    lim.add_argument("--max-consumers", type=int, default=1024, help="consumers of the run's account (default 1024)")
    lim.add_argument("--monitor-port", type=int, help="HTTP monitoring on 127.0.0.1:PORT (off by default)")
    c = a.add_argument_group("cluster routes (the route listener needs a password: cluster.conf)")
    c.add_argument("--cluster-routes", help="HOST:PORT of every server's route listener, comma-separated")
    c.add_argument("--cluster-name", default="relax", help="cluster name (default relax)")
    c.add_argument("--cluster-listen", help="where this server listens for routes (default HOST:6222, HOST of --host)")

    return p, sub


def main(
    argv: Sequence[str] | None = None,
    *,
    parser: argparse.ArgumentParser | None = None,
    commands: dict[str, Command] | None = None,
    config_model: Callable[[], type[RunConfig]] | None = None,
    preflight: Callable[[RunConfig], None] | None = None,
) -> int:
    """Parse, run one command, and turn the bus's deliberate errors into `relax: error: ...` and their exit code
    (2 for a wrong input, 75 for an outage: `relax_bus.errors`).

    `config_model` returns the run config model the commands read configs as (default: the bus's own);
    it is called after parsing, so `--help` imports nothing heavy. `preflight` checks a config before
    `relax init` touches the server (the roles' package checks that its model, task and rewards can be
    used; it raises ConfigError); commands find it as `args.preflight`."""
    parser = parser or build_parser()[0]
    args, extra = parser.parse_known_args(argv)
    # `relax run CONFIG --steps 3 trainer.optim.lr=1e-4`: argparse gives up on positionals after an option,
    # so assignments that come after a flag arrive here; anything else is an error, as parse_args makes it.
    if extra and isinstance(getattr(args, "overrides", None), list) and all(_is_assignment(e) for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "probe":  # before logging and settings (pydantic: ~0.5 s): a probe runs every few seconds
        return _probe(args)
    from relax_bus import log
    from relax_bus.errors import RelaxBusError
    from relax_bus.settings import RunConfig

    log.configure(args.log_level)
    args.preflight = preflight
    try:
        model = config_model() if config_model is not None else RunConfig
        result = {**COMMANDS, **(commands or {})}[args.command](args, model)
        return asyncio.run(result) if asyncio.iscoroutine(result) else result  # type: ignore[return-value]
    except RelaxBusError as err:
        print(f"relax: error: {err}", file=sys.stderr)
        return err.exit_code  # 2: the input is wrong, final; 75: an outage, worth another attempt (relax_bus.errors)
    except KeyboardInterrupt:
        return 130


def _is_assignment(arg: str) -> bool:
    return not arg.startswith("-") and "=" in arg


async def _init(args: argparse.Namespace, config_model: type[RunConfig]) -> int:
    from relax_bus.connection import connect
    from relax_bus.provision import provision_when_ready

    config = config_with_overrides(args, config_model)
    if args.preflight is not None and not args.no_check:  # before the server: a config that cannot work is refused
        await asyncio.to_thread(args.preflight, config)
    started = time.monotonic()
    nc = await connect(connection_settings(args), name="relax-init", retry_for_s=args.wait)
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


async def _inspect(args: argparse.Namespace, config_model: type[RunConfig]) -> int:
    from relax_bus.connection import connect
    from relax_bus.ops.run_report import gather, render

    nc = await connect(connection_settings(args), name="relax-inspect")
    try:
        info = await gather(nc.jetstream(timeout=10.0), args.run, nc)
    finally:
        await nc.close()
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


def _probe(args: argparse.Namespace) -> int:
    """`relax probe ready|live`: one line saying why, exit 0 if the probe passes, 1 if not."""
    passes, why = probe(args.kind, args.heartbeat_file)
    print(f"{args.kind}: {'yes' if passes else 'no'}: {why}")
    return 0 if passes else 1


def _decode(args: argparse.Namespace, config_model: type[RunConfig]) -> int:
    indent = None if args.compact or args.lines else 2
    inputs = [line for line in sys.stdin.buffer if line.strip()] if args.lines else [sys.stdin.buffer.read()]
    try:
        return _decode_each(inputs, args.lines, indent)
    except BrokenPipeError:  # tolerated: the reader stopped early (`relax decode | head`)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - so that the exit's flush does not raise again
        return 0


def _decode_each(inputs: list[bytes], lines: bool, indent: int | None) -> int:
    from relax_bus.ops.message_json import Undecodable, line_to_json, to_json

    status = 0
    for n, data in enumerate(inputs, 1):
        where = f"line {n}: " if lines else ""
        try:
            out, warning = line_to_json(data) if lines else to_json(data)
        except Undecodable as err:  # deliberate: bad input is the user's to see, in one line per message
            print(f"relax: error: {where}{err}", file=sys.stderr)
            status = 2
            continue
        # strict JSON: NaN and +-infinity are null already (`message_json`); one left would raise, not print
        print(json.dumps(out, indent=indent, default=str, allow_nan=False), flush=True)
        if warning:
            print(f"relax: warning: {where}{warning}", file=sys.stderr)
            status = max(status, 1)
    return status


COMMANDS: dict[str, Command] = {
    "server": server_command,
    "init": _init,
    "inspect": _inspect,
    "auth": auth_command,
    "decode": _decode,
}

if __name__ == "__main__":
    sys.exit(main())

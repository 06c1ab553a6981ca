"""The `relax` command: the bus's commands (`relax_bus.ops.cli`) plus the roles' and the trainer's.

    relax server | init | inspect | auth     the bus (run configs are read as the pipeline's)
    relax worker ROLE --run RUN               one role of an initialised run (roles: the registry's)
    relax probe ready|live --heartbeat-file F  a container probe of the worker started with that file
    relax env serve MODULE:CLASS --run RUN    an environment class as one instance of the run's env service
    relax run CONFIG [section.key=value ...]  a whole run on this machine (overrides validated with CONFIG)
    relax replay RUN --step N                 recompute one step from its checkpoint
    relax config show CONFIG [k=v ...]        the effective config, defaults and chain included
    relax config check CONFIG [k=v ...]       the config, and whether its model, task, rewards and engine work here
    relax decode                              a message body (msgpack) from stdin as JSON
    relax --version                           this package's version and the pinned nats-server's
    relax model import-gguf [GGUF] --out DIR  a GGUF file (default: SmolLM2-135M-Instruct) as an HF directory
    relax model warmup CONFIG --out DIR       CONFIG's policy after its supervised warm-up, as an HF directory
    relax model judge-train CONFIG --out DIR  a judge (CONFIG's judge section) trained on its policy's labelled samples
                                              (--samples RUN/samples.jsonl: the run's judge retrained on what it logged)
    relax export RUN --out DIR [--step N] [--merge]  a run's checkpoint as an HF directory (LoRA: its adapter)

Arguments are parsed before anything heavy is imported; a role imports only what its module needs.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from relax_bus.errors import ConfigError
from relax_bus.ops.arguments import (
    CONFIG_HELP,
    LOG_LEVELS,
    Command,
    config_with_overrides,
    connection_settings,
    with_nats,
    with_overrides,
)
from relax_bus.ops.cli import build_parser
from relax_bus.ops.cli import main as bus_main
from workers.model_cli import add_model_commands, model_command
from workers.role_registry import ROLE_NAMES

if TYPE_CHECKING:
    from relax_bus.settings import RunConfig
    from workers.config import PipelineConfig


def _parser() -> argparse.ArgumentParser:
    p, sub = build_parser()
    w = with_nats(sub.add_parser("worker", help="run one role of an initialised run (its config comes from KV)"))
    w.add_argument("role", choices=ROLE_NAMES, help="the role to run")
    w.add_argument("--run", "--run-id", dest="run", required=True, help="run id")
    w.add_argument("--work-dir", default="./.relax/work", help="local cache for model files (default ./.relax/work)")
    w.add_argument("--threads", type=int, default=1, help="torch threads of this process (default 1)")
    w.add_argument(
        "--heartbeat-file",
        type=Path,
        help="also record each heartbeat in this file, for container probes (`relax probe ready|live`)",
    )
    w.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS,
        help="log level (also accepted before the command)",
    )

    v = sub.add_parser("env", help="environments of agentic runs")
    v_sub = v.add_subparsers(dest="env_command", required=True, metavar="ACTION")
    vs = with_nats(
        v_sub.add_parser("serve", help="serve an environment class on the bus (one instance of the run's env service)")
    )
    vs.add_argument("env", metavar="MODULE:CLASS", help="the environment: module:Class, or a built-in (calculator)")
    vs.add_argument("--run", "--run-id", dest="run", required=True, help="run id")
    vs.add_argument("--options", default="{}", help="the class's keyword arguments, a JSON object (default {})")

    y = with_nats(sub.add_parser("replay", help="recompute one step of a run from its checkpoint and compare the loss"))
    y.add_argument("run", help="run id")
    y.add_argument("--step", type=int, required=True, help="the step to recompute")
    y.add_argument("--work-dir", default="./.relax/work", help="local cache for model files (default ./.relax/work)")
    y.add_argument("--json", action="store_true", help="print the result as JSON")

    r = sub.add_parser("run", help="run a whole training run locally: NATS, every role, progress, reward curve")
    r.add_argument(
        "config",
        help=CONFIG_HELP,
    )
    with_overrides(r)
    r.add_argument("--nats-url", help="use this NATS server instead of starting an embedded one")
    r.add_argument(
        "--auth",
        metavar="DIR",
        help="with --nats-url: the run's users from `relax auth` (each role its <role>.env, the launcher admin.env)",
    )
    r.add_argument("--run-dir", help="where metrics, curve, logs and the NATS store go (default runs/<run>)")
    r.add_argument("--steps", type=int, help="override trainer.steps (as trainer.steps=N; wins over it)")
    r.add_argument("--run-id", help="override the config's run id (as run=ID; wins over it)")

    c = sub.add_parser("config", help="check a run config and print it with every default filled in")
    c_sub = c.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = c_sub.add_parser("show", help="validate CONFIG and print the effective config (defaults and chain)")
    show.add_argument(
        "config",
        help=CONFIG_HELP,
    )
    with_overrides(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    check = c_sub.add_parser(
        "check", help="validate CONFIG and check that its model, task, rewards and engine can be used here"
    )
    check.add_argument("config", help=CONFIG_HELP)
    with_overrides(check)

    add_model_commands(sub)

    cmp = sub.add_parser("compare", help="runs side by side: how far each one's reward rose, and their curves")
    cmp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories of `relax run` (runs/<run>)")
    cmp.add_argument("--out", help="write the curves to this PNG (and the figures beside it as JSON)")

    e = with_nats(sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model directory"))
    e.add_argument("run", help="run id")
    e.add_argument("--out", required=True, help="the directory to write (must not exist or be empty)")
    e.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    e.add_argument("--run-dir", help="the run's directory when no --nats-url is given (default runs/<run>)")
    e.add_argument("--work-dir", default="./.relax/work", help="local cache for model files (default ./.relax/work)")
    e.add_argument("--merge", action="store_true", help="a LoRA run: write the merged model, not the adapter")
    return p


async def _worker(args: argparse.Namespace, config_model: type[RunConfig]) -> int:
    from workers.roles.serve import run_role

    # How a stalled role is read: `kill -USR1 PID` writes every thread's stack to stderr (the role's
    # log), `kill -USR2 PID` every asyncio task's (where each coroutine waits).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, _dump_tasks)
    settings = connection_settings(args)
    return await run_role(args.role, settings, args.run, Path(args.work_dir), args.threads, args.heartbeat_file)


async def _env(args: argparse.Namespace, config_model: type[RunConfig]) -> int:
    from relax_bus.connection import connect
    from workers.envs.service import serve_env

    try:
        options = json.loads(args.options)
    except ValueError as err:
        raise ConfigError("relax env serve --options", [f"not JSON: {err}"]) from None
    if not isinstance(options, dict):
        raise ConfigError("relax env serve --options", ["a JSON object of keyword arguments, {...}"])
    settings = connection_settings(args)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    nc = await connect(settings, name="relax-env", retry_for_s=settings.connect_retry_s)
    try:
        try:
            server = await serve_env(nc, args.run, args.env, options)
        except ValueError as err:  # deliberate: a wrong class or options is the user's to fix, in one line
            raise ConfigError("relax env serve", [str(err)]) from None
        print(f"serving {args.env} for run {args.run} as instance {server.instance} (Ctrl-C stops)", flush=True)
        await stop.wait()
        await server.stop()
    finally:
        if not nc.is_closed:
            await nc.drain()
    return 0


def _dump_tasks() -> None:
    for task in asyncio.all_tasks():
        print(f"--- asyncio task {task.get_name()}", file=sys.stderr)
        task.print_stack(file=sys.stderr)
    sys.stderr.flush()


async def _replay(args: argparse.Namespace, config_model: type[RunConfig]) -> int:
    from relax_bus.bus import Bus
    from workers.config import PipelineConfig
    from workers.launch import replay

    async with await Bus.connect(
        connection_settings(args), args.run, name="relax-replay", config_model=PipelineConfig
    ) as bus:
        result = await replay.replay(bus, args.step, Path(args.work_dir))
    print(json.dumps(result.as_dict(), indent=2) if args.json else replay.render(result))
    return 0 if result.matches() else 1


async def _run(args: argparse.Namespace, config_model: type[RunConfig]) -> int:
    from workers.config import PipelineConfig
    from workers.launch import launcher

    sugar = {"run": args.run_id, "trainer.steps": args.steps}
    config = config_with_overrides(args, PipelineConfig, **sugar)
    run_dir = Path(args.run_dir or f"runs/{config.run}")
    # SIGTERM (a supervisor, `kill PID`) stops the run as Ctrl-C does: every role and the embedded server are
    # stopped by PID on the way out, instead of being left running without their parent.
    # The launcher also checks `stopping` between events: on Python 3.11 a lone cancel that lands as one of
    # nats-py's waits completes is swallowed (see relax_bus/cancel.py), and a busy run completes them often.
    task = asyncio.current_task()
    assert task is not None
    stopping = asyncio.Event()

    def on_sigterm() -> None:
        stopping.set()
        task.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        if args.auth and not args.nats_url:
            raise ConfigError("--auth", ["only with --nats-url: the embedded server makes its own users"])
        auth_dir = Path(args.auth) if args.auth else None
        summary = await launcher.launch(config, run_dir, args.nats_url, sys.stdout, stopping, auth_dir)
    except asyncio.CancelledError:
        print(f"\nrun {config.run}: stopped by SIGTERM; every role was stopped (logs: {run_dir / 'logs'})")
        return 143
    print(
        f"\nrun {summary['run']}: {summary['steps']} steps in {summary['wall_s']}s, "
        f"reward {summary['reward_start']} -> {summary['reward_end']}"
    )
    print(f"metrics: {summary['metrics']}")
    print(f"reward curve: {summary['curve']}")
    restarts = [f"{label} {n}" for label, n in summary["restarts"].items()]
    if summary.get("nats_restarts"):
        restarts.append(f"NATS {summary['nats_restarts']}")
    if restarts:
        print(f"restarts: {', '.join(restarts)}")
    return 0


def _config(args: argparse.Namespace, config_model: type[RunConfig]) -> int:
    import yaml

    from workers.config import PipelineConfig

    config = config_with_overrides(args, PipelineConfig)
    if args.config_command == "check":
        _preflight(config)  # ConfigError: every problem, exit 2
        roles = ", ".join(r.name for r in config.chain)
        print(
            f"config ok: run {config.run}, model {config.model.source.shorthand()}, task {config.task.type}, "
            f"roles {roles}"
        )
        return 0
    data = config.model_dump(mode="json")
    data["chain"] = data.pop("chain")  # derived from the rest: shown last
    print(json.dumps(data, indent=2) if args.json else yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def _compare(args: argparse.Namespace, config_model: type[RunConfig]) -> int:
    from workers.launch.compare import compare

    try:
        text, _ = compare([Path(d) for d in args.run_dirs], Path(args.out) if args.out else None)
    except ValueError as err:
        print(f"relax compare: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


async def _export(args: argparse.Namespace, config_model: type[RunConfig]) -> int:
    from workers.launch.export import export, run_bus

    settings = connection_settings(args) if args.nats_url else None
    async with run_bus(args.run, settings, Path(args.run_dir or f"runs/{args.run}")) as bus:
        result = await export(bus, Path(args.out), args.step, Path(args.work_dir), args.merge)
    print(f"run {result['run']} step {result['step']} exported to {result['out']}: {', '.join(result['files'])}")
    return 0


COMMANDS: dict[str, Command] = {
    "worker": _worker,
    "env": _env,
    "replay": _replay,
    "run": _run,
    "config": _config,
    "model": model_command,
    "export": _export,
    "compare": _compare,
}


def _pipeline_config() -> type[PipelineConfig]:
    from workers.config import PipelineConfig

    return PipelineConfig


def _preflight(config: RunConfig) -> None:
    """The pre-start check of `relax init` and `relax config check` (`workers.preflight`; imported when used)."""
    from workers.config import PipelineConfig
    from workers.preflight import check_config

    assert isinstance(config, PipelineConfig), "the relax command reads run configs as PipelineConfig"
    check_config(config)


def main(argv: Sequence[str] | None = None) -> int:
    return bus_main(argv, parser=_parser(), commands=COMMANDS, config_model=_pipeline_config, preflight=_preflight)


if __name__ == "__main__":
    sys.exit(main())

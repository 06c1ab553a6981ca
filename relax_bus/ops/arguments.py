"""What the `relax` commands share: the flags every command that connects or reads a run config takes,
and turning them into connection settings and a validated config. Both command modules
(`relax_bus.ops.cli`, `relax_bus.ops.cli_server`) and the roles' command line use it."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax_bus.settings import C, RunConfig

Command = Callable[[argparse.Namespace, "type[RunConfig]"], "int | Awaitable[int]"]
"""A subcommand: given the parsed arguments and the run config model, an exit code (or a coroutine)."""
LOG_LEVELS = ["debug", "info", "warning", "error"]
CONFIG_HELP = (
    "run config, YAML or JSON (every key: docs/configuration.md; `relax config show CONFIG` fills in defaults)"
)
OVERRIDES_HELP = (
    "settings over CONFIG's, each section.key=value with a YAML value (trainer.optim.lr=1e-4, "
    "rollout.engine.type=vllm, 'rewards=[{type: exact}]'), validated with the file"
)


class NoAbbrevParser(argparse.ArgumentParser):
    """An argparse parser that takes flags only as spelled: `relax run CONFIG --step 3` is an error, not
    `--steps 3` (`allow_abbrev=False`). Its subcommands' parsers are of this class too (argparse builds them
    with the parent's), so no level of `relax` takes an abbreviation."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def with_overrides(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `section.key=value ...` positionals a command that reads CONFIG takes after it."""
    sp.add_argument("overrides", nargs="*", metavar="section.key=value", help=OVERRIDES_HELP)
    return sp


def with_nats(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `--nats-url` flag every command that connects takes."""
    sp.add_argument(
        "--nats-url",
        help="NATS server URL(s), comma-separated (default: $RELAX_NATS_URL or nats://127.0.0.1:4222)",
    )
    return sp


def size(text: str) -> int:
    """A byte count flag: `1048576`, `512M`, `32G` (powers of 1024)."""
    from relax_bus.ops.server_conf import parse_size

    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def config_with_overrides(args: argparse.Namespace, model: type[C], **sugar: Any) -> C:
    """`args.config` read as `model` with `args.overrides` (and `sugar`, dotted keys set by flags) applied."""
    from relax_bus.overrides import load_with_overrides, parse_overrides

    overrides = parse_overrides(getattr(args, "overrides", None) or [])
    overrides.update({k: v for k, v in sugar.items() if v is not None})
    return load_with_overrides(args.config, overrides, model)


def connection_settings(args: argparse.Namespace) -> Any:
    """Connection settings from `--nats-url` and the RELAX_* environment."""
    from pydantic import ValidationError

    from relax_bus.errors import ConfigError
    from relax_bus.settings import ConnectionSettings, validation_problems

    try:
        overrides = {"nats_url": args.nats_url} if getattr(args, "nats_url", None) else {}
        return ConnectionSettings(**overrides)
    except ValidationError as err:
        raise ConfigError("connection settings (flags / RELAX_* environment)", validation_problems(err)) from None

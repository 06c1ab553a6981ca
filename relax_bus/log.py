"""structlog set-up: key-value lines on a terminal, JSON lines otherwise."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info", json: bool | None = None) -> None:
    """Configure structlog (and the stdlib root logger nats-py uses) once per process."""
    if json is None:
        json = not sys.stderr.isatty()
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr, format="%(name)s: %(message)s")
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]

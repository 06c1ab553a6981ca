"""structlog set-up: key-value lines on a terminal, JSON lines otherwise.

Libraries log through the stdlib `logging` module (nats-py, transformers, vLLM, torch). Off a terminal
their records go through structlog's `ProcessorFormatter`, so stderr is one JSON object per line with
the same keys as our own events (`event`, `level`, `timestamp`, `logger`; `exception` with a
traceback). Some libraries install a handler of their own and stop propagation (transformers writes to
stderr, vLLM to stdout, torch to stderr): their loggers are adopted, that is kept free of handlers
and propagating to the root logger's one handler, whether the library is imported before or after.
On a terminal the rendering is as before: structlog's console lines, and `name: message` for the
libraries.

Every event of a role says whose it is: a role process binds `run` and `role` as it starts (`relax worker`),
and each loop of the bus that runs for a role binds `worker`, its worker id (the one its heartbeat and
`relax inspect` show), while it runs (`relax_bus.loop`, with `bound`). They reach every event logged in that
context (`merge_contextvars`), off a terminal the libraries' records too; the tasks and `asyncio.to_thread`
calls started from it inherit them.

The retry loops (`relax_bus.backoff`, stamina) log their own events; stamina's per-retry hook becomes one
debug event, `retry_scheduled` (its default is a warning per retry with the arguments' reprs, and a Prometheus
counter in whichever process has prometheus-client).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import structlog
from stamina.instrumentation import RetryDetails, set_on_retry_hooks

ADOPTED_LOGGERS = ("transformers", "vllm", "torch")
"""Library loggers that would otherwise write past the root handler (their own handler, no propagation)."""


HANDLER_NAME = "relax"
"""Name of the root handler `configure` installs (so that a second call replaces it)."""


class _AdoptedLogger(logging.Logger):
    """A library logger that keeps no handlers of its own and always propagates to the root logger."""

    def addHandler(self, hdlr: logging.Handler) -> None:
        pass  # deliberate: the root logger's handler formats this library's records

    @property
    def propagate(self) -> bool:
        return True

    @propagate.setter
    def propagate(self, value: bool) -> None:
        pass  # deliberate: a library turning propagation off would bypass the root handler


def _adopted(name: str) -> bool:
    return any(name == top or name.startswith(top + ".") for top in ADOPTED_LOGGERS)


class _LibraryAwareLogger(logging.Logger):
    """The logger class of loggers created after `configure`: an adopted one for the adopted libraries' names
    (torch registers a handler on many of its own loggers, not just on `torch`), a plain one otherwise."""

    def __init__(self, name: str, level: int = logging.NOTSET) -> None:
        super().__init__(name, level)
        if _adopted(name):
            self.__class__ = _AdoptedLogger  # type: ignore[assignment]  # the same layout, other methods


def _adopt_library_loggers() -> None:
    """Adopt the libraries' loggers that exist already, and those created from now on."""
    existing = [n for n, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)]
    for name in [*ADOPTED_LOGGERS, *existing]:
        if _adopted(name):
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            logger.__class__ = _AdoptedLogger
    if logging.getLoggerClass() is logging.Logger:
        logging.setLoggerClass(_LibraryAwareLogger)


class _NamedPrintLogger(structlog.PrintLogger):
    """structlog's print logger plus the name it was asked for (`structlog.stdlib.add_logger_name` reads it)."""

    def __init__(self, file: TextIO, name: str | None) -> None:
        super().__init__(file)
        self.name = name or ""


def _named_print_logger(*args: Any) -> _NamedPrintLogger:
    return _NamedPrintLogger(sys.stderr, args[0] if args else None)


def configure(level: str = "info", json: bool | None = None) -> None:
    """Configure structlog and the stdlib root logger once per process (calling it again replaces both)."""
    if json is None:
        json = not sys.stderr.isatty()
    lvl = getattr(logging, level.upper(), logging.INFO)
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            *shared,
            *([structlog.stdlib.add_logger_name] if json else []),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=_named_print_logger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(HANDLER_NAME)
    if json:
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, structlog.processors.format_exc_info],
                processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == HANDLER_NAME]:
        root.removeHandler(old)  # an earlier configure()'s; other handlers (a test's capture) stay
    root.addHandler(handler)
    # Libraries stay at warning and above (nats-py's reconnect chatter is info) unless asked for less.
    root.setLevel(max(lvl, logging.WARNING))
    _adopt_library_loggers()
    logging.captureWarnings(json)  # `warnings.warn` (torch, transformers) as records, so as JSON lines too
    set_on_retry_hooks([_log_retry])


def _log_retry(details: RetryDetails) -> None:
    """stamina's hook, after a failed attempt: one debug event (the retry loop logs the operation itself)."""
    get_logger("relax_bus.backoff").debug(
        "retry_scheduled",
        retry=details.retry_num,
        error=type(details.caused_by).__name__,
        wait_s=round(details.wait_for, 2),
        waited_s=round(details.waited_so_far, 2),
    )


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger named `name` (the `logger` key of its JSON lines)."""
    return structlog.get_logger(name)  # type: ignore[no-any-return]


@contextlib.contextmanager
def bound(**fields: str) -> Iterator[None]:
    """Add `fields` to every log event emitted in this context until the block ends: this task's, and those of
    the tasks and `asyncio.to_thread` calls it starts meanwhile (`structlog.contextvars`). A field given to the
    event itself wins over a bound one."""
    with structlog.contextvars.bound_contextvars(**fields):
        yield

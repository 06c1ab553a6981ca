"""Connecting to NATS: one place that turns settings into a client with sane long-run options."""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path

import nats
import nats.errors
from nats.aio.client import DEFAULT_INBOX_PREFIX
from nats.aio.client import Client as NATS

from relax_bus.backoff import retrying
from relax_bus.errors import ConfigError, NatsRefused, NatsUnreachable
from relax_bus.log import get_logger
from relax_bus.outage import note_denied
from relax_bus.settings import ConnectionSettings, has_secret, redacted

log = get_logger(__name__)

_LINK_ERRORS = (nats.errors.UnexpectedEOF, nats.errors.StaleConnectionError, OSError)
"""What nats-py reports when the connection itself breaks (an outage begins), as opposed to a protocol error."""


def tls_context(settings: ConnectionSettings) -> ssl.SSLContext | None:
    """An SSL context when any TLS file is configured (or a URL uses tls://), else None."""
    wants_tls = settings.tls_ca_file or settings.tls_cert_file or any(u.startswith("tls://") for u in settings.nats_url)
    if not wants_tls:
        return None
    ctx = ssl.create_default_context(cafile=str(settings.tls_ca_file) if settings.tls_ca_file else None)
    if settings.tls_cert_file and settings.tls_key_file:
        ctx.load_cert_chain(str(settings.tls_cert_file), str(settings.tls_key_file))
    return ctx


SECRET_VARIABLES = ("RELAX_PASSWORD", "RELAX_TOKEN")
"""Environment variables `ConnectionSettings` reads that are secrets themselves (RELAX_NATS_URL is one when it
carries a password or a token)."""


def forget_credentials(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Remove the secrets the connection settings were read from, once connected: the client keeps its own
    copy for reconnecting, and nothing this process starts afterwards inherits them. Returns the names
    removed. A process that starts others needing the bus (`relax run`) must not call it."""
    names = [n for n in SECRET_VARIABLES if n in environ]
    if has_secret(environ.get("RELAX_NATS_URL", "")):
        names.append("RELAX_NATS_URL")
    for name in names:
        del environ[name]
    return names


def check_login_files(settings: ConnectionSettings) -> None:
    """Fail early, naming the file, when a configured creds or nkey seed file cannot log in.

    nats-py reads them only while connecting and reports a bad one as a failed connection; a person
    should read which file is wrong, not "cannot reach NATS"."""
    problems = []
    for name, path in (("creds_file", settings.creds_file), ("nkey_seed_file", settings.nkey_seed_file)):
        if path is not None and (problem := _login_file_problem(path, creds=name == "creds_file")):
            problems.append(f"RELAX_{name.upper()} {path}: {problem}")
    if problems:
        raise ConfigError("connection settings (login files)", problems)


def _login_file_problem(path: Path, *, creds: bool) -> str | None:
    """Why `path` is no usable `.creds` file (creds) or nkey user seed file, or None."""
    try:
        text = path.read_text()
    except OSError as err:
        return err.strerror or type(err).__name__
    if creds:
        blocks = ("-----BEGIN NATS USER JWT-----", "-----BEGIN USER NKEY SEED-----")
        if not all(b in text for b in blocks):
            return "not a NATS credentials file (it needs a USER JWT and a USER NKEY SEED block)"
        lines = text.split("-----BEGIN USER NKEY SEED-----", 1)[1].strip().splitlines()
        text = lines[0] if lines else ""
    try:
        import nkeys  # type: ignore[import-untyped]
    except ImportError:
        return "nkey logins need the `nkeys` package (pip install nkeys)"
    try:
        prefix, _ = nkeys.decode_seed(bytearray(text.strip().encode()))
    except Exception:  # nkeys raises several types for a malformed seed: each means the same here
        return "no valid nkey seed in it"
    if prefix != nkeys.PREFIX_BYTE_USER:
        return "the seed is not a user's (SU...)"
    return None


async def connect(
    settings: ConnectionSettings,
    *,
    name: str = "relax",
    retry_for_s: float = 0.0,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    on_outage: Callable[[float | None], None] | None = None,
) -> NATS:
    """Connect, retrying the first connection for up to `retry_for_s` seconds.

    Once connected, the client reconnects forever (long-running workers must survive a server
    restart). Raises NatsUnreachable with a one-line reason when the first connection fails.
    An outage is reported once, not per reconnect attempt: a warning when it starts and one line
    with its length when it ends, or, given `on_outage`, a call with its start (`time.time()`) and
    one with None at its end, and no log lines (the caller shows it its own way).
    """
    check_login_files(settings)
    urls = ", ".join(redacted(u) for u in settings.nats_url)
    holder: list[NATS] = []
    tls = tls_context(settings)

    first_errors: list[str] = []
    outage: dict[str, float] = {}  # "since" (time.time()) and "failed" attempts, while disconnected

    async def error_cb(err: Exception) -> None:
        text = f"{type(err).__name__}: {err}".strip()
        if not holder:  # still connecting: reported once, in NatsUnreachable
            first_errors.append(text)
            return
        if "permissions violation" in text.lower():
            note_denied(text)
        elif outage:  # a failed reconnect attempt: counted, reported when the outage ends
            outage["failed"] += 1
            return
        elif on_outage is not None and isinstance(err, _LINK_ERRORS):
            return  # the connection broke: the outage is reported through on_outage
        # nats-py reports permission violations and socket errors only here: always log them.
        log.warning("nats_error", error=text)

    async def disconnected_cb() -> None:
        if holder and (holder[0].is_closed or holder[0].is_draining):
            return  # our own close, not an outage
        if outage:
            return  # a reconnect attempt that failed: the same outage
        outage.update(since=time.time(), failed=0)
        if on_outage is not None:
            on_outage(outage["since"])
        else:
            log.warning("nats_disconnected", servers=urls, retrying_every_s=0.5)

    async def reconnected_cb() -> None:
        down_s, failed = time.time() - outage.get("since", time.time()), int(outage.get("failed", 0))
        outage.clear()
        if on_outage is not None:
            on_outage(None)
        else:
            log.info("nats_reconnected", servers=urls, down_s=round(down_s, 1), failed_attempts=failed)
        if on_reconnect is not None:
            await on_reconnect()

    connect_timeout = max(1, round(settings.connect_timeout_s))
    # nats-py can hang closing a socket whose TLS handshake failed: bound each attempt (two per server).
    attempt_s = 2 * len(settings.nats_url) * (connect_timeout + 1)
    deadline = time.monotonic() + retry_for_s

    async def attempt_connect(attempt: int) -> NATS:
        try:
            connecting = nats.connect(
                servers=list(settings.nats_url),
                name=name,
                connect_timeout=connect_timeout,
                allow_reconnect=True,
                max_reconnect_attempts=1,
                reconnect_time_wait=0.1,
                error_cb=error_cb,
                disconnected_cb=disconnected_cb,
                reconnected_cb=reconnected_cb,
                user=settings.user,
                password=settings.password,
                token=settings.token,
                user_credentials=str(settings.creds_file) if settings.creds_file else None,
                nkeys_seed=str(settings.nkey_seed_file) if settings.nkey_seed_file else None,
                tls=tls,
                # Per-user reply subjects (relax_bus.ops.auth); nats-py's _INBOX otherwise.
                inbox_prefix=settings.inbox_prefix or DEFAULT_INBOX_PREFIX,
            )
            return await asyncio.wait_for(connecting, attempt_s)
        except Exception as err:  # nats-py raises many types on a failed first connect
            if (left := deadline - time.monotonic()) > 0:
                error = (first_errors or [type(err).__name__])[-1]
                log.info("nats_connect_retry", servers=urls, attempt=attempt, error=error, left_s=round(left, 1))
            raise

    try:
        # Waits of 0.2 s doubling up to 2 s, plus up to 0.5 s of jitter (relax_bus.backoff).
        async for attempt in retrying(Exception, retry_for_s, wait_initial=0.2, wait_max=2.0, jitter=0.5):
            with attempt:
                nc = await attempt_connect(attempt.num)
    except Exception as err:
        # A refused login or certificate is the reason, not the reset or timeout that follows it.
        refused = [e for e in first_errors if "authorization violation" in e.lower() or "certificate" in e.lower()]
        reason = (refused or first_errors or [f"{type(err).__name__}: {err}"])[-1]
        raise (NatsRefused if refused else NatsUnreachable)(f"cannot reach NATS at {urls} ({reason})") from None
    holder.append(nc)
    # Connected: from now on reconnect without limit, slowly.
    nc.options["max_reconnect_attempts"] = -1
    nc.options["reconnect_time_wait"] = 0.5
    return nc

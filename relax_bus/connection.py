"""Connecting to NATS: one place that turns settings into a client with sane long-run options."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import DEFAULT_INBOX_PREFIX
from nats.aio.client import Client as NATS

from relax_bus.errors import NatsUnreachable
from relax_bus.log import get_logger
from relax_bus.outage import note_denied
from relax_bus.settings import ConnectionSettings

log = get_logger(__name__)


def tls_context(settings: ConnectionSettings) -> ssl.SSLContext | None:
    """An SSL context when any TLS file is configured (or a URL uses tls://), else None."""
    wants_tls = settings.tls_ca_file or settings.tls_cert_file or any(u.startswith("tls://") for u in settings.nats_url)
    if not wants_tls:
        return None
    ctx = ssl.create_default_context(cafile=str(settings.tls_ca_file) if settings.tls_ca_file else None)
    if settings.tls_cert_file and settings.tls_key_file:
        ctx.load_cert_chain(str(settings.tls_cert_file), str(settings.tls_key_file))
    return ctx


async def connect(
    settings: ConnectionSettings,
    *,
    name: str = "relax",
    retry_for_s: float = 0.0,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
) -> NATS:
    """Connect, retrying the first connection for up to `retry_for_s` seconds.

    Once connected, the client reconnects forever (long-running workers must survive a server
    restart). Raises NatsUnreachable with a one-line reason when the first connection fails.
    """
    urls = ", ".join(settings.nats_url)
    holder: list[NATS] = []
    tls = tls_context(settings)

    first_errors: list[str] = []

    async def error_cb(err: Exception) -> None:
        text = f"{type(err).__name__}: {err}".strip()
        if not holder:  # still connecting: reported once, in NatsUnreachable
            first_errors.append(text)
            return
        # nats-py reports permission violations and socket errors only here: always log them.
        log.warning("nats_error", error=text)
        if "permissions violation" in text.lower():
            note_denied(text)

    async def disconnected_cb() -> None:
        if holder and (holder[0].is_closed or holder[0].is_draining):
            return  # our own close, not an outage
        log.warning("nats_disconnected", servers=urls)

    async def reconnected_cb() -> None:
        log.info("nats_reconnected", servers=urls)
        if on_reconnect is not None:
            await on_reconnect()

    connect_timeout = max(1, round(settings.connect_timeout_s))
    # nats-py can hang closing a socket whose TLS handshake failed: bound each attempt (two per server).
    attempt_s = 2 * len(settings.nats_url) * (connect_timeout + 1)
    deadline = time.monotonic() + retry_for_s
    delay = 0.2
    while True:
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
                tls=tls,
                # Per-user reply subjects (relax_bus.auth); nats-py's _INBOX otherwise.
                inbox_prefix=settings.inbox_prefix or DEFAULT_INBOX_PREFIX,
            )
            nc = await asyncio.wait_for(connecting, attempt_s)
        except Exception as err:  # nats-py raises many types on a failed first connect
            if time.monotonic() + delay < deadline:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            # A refused login or certificate is the reason, not the reset or timeout that follows it.
            refused = [e for e in first_errors if "authorization violation" in e.lower() or "certificate" in e.lower()]
            reason = (refused or first_errors or [f"{type(err).__name__}: {err}"])[-1]
            raise NatsUnreachable(f"cannot reach NATS at {urls} ({reason})") from None
        holder.append(nc)
        # Connected: from now on reconnect without limit, slowly.
        nc.options["max_reconnect_attempts"] = -1
        nc.options["reconnect_time_wait"] = 0.5
        return nc

"""The NATS server `relax run` starts for a run, secured and kept alive.

Secure by default: the server runs with one least-privilege user per role of the run's chain (plus
admin and observer, `relax_bus.ops.auth`), written by `relax_bus.ops.credentials.write_bundle` into
`<run dir>/auth` (0600 files, bcrypt hashes only in the server's config). The launcher connects as
admin; each role process is given only its own user's RELAX_* variables. Credentials are new for every
`relax run`; `<run dir>/auth/observer.env` lets `relax inspect` look at the run while it trains.

Kept alive: `check()` restarts a server that died, on the same port and store (the streams survive), and
reports each outage in two lines ("exited ... restarting", "back after ..."), as a supervisor should.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from relax_bus.backoff import retrying
from relax_bus.errors import NatsServerFailed
from relax_bus.ops.credentials import Bundle, write_bundle
from relax_bus.ops.server import EmbeddedServer
from relax_bus.settings import ConnectionSettings, RunConfig
from workers.errors import RunFailed

RESTART_ATTEMPTS = 10
"""Tries (0.5 s apart, doubling up to 2 s, with jitter) to bring a dead server back before the run fails."""


class RunServer:
    """The embedded nats-server of one `relax run`, with per-role users, restarted when it dies."""

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        self.server = EmbeddedServer(store_dir=run_dir / "nats")
        self.bundle: Bundle = write_bundle(
            config,
            run_dir / "auth",
            host=self.server.host,
            port=self.server.port,
            store_dir=None,  # the server's own -sd flag names it
            force=True,  # a new run of the same directory: new passwords, the same store
        )
        self.server.config_file = self.bundle.server_conf
        self.restarts = 0

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> RunServer:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def settings(self, role: str = "admin") -> ConnectionSettings:
        """How `role` (a role of the run, or admin/observer) connects."""
        return settings_from_env(self.bundle.credentials[role].env(self.url), self.url)

    def role_env(self) -> dict[str, dict[str, str]]:
        """Each role's RELAX_* variables: its own user, nobody else's."""
        return {role: cred.env(self.url) for role, cred in self.bundle.credentials.items()}

    async def check(self, note: Callable[[str], None]) -> None:
        """Restart the server if it died; RunFailed if it cannot be brought back."""
        proc = self.server.proc
        if proc is None or (code := proc.poll()) is None:
            return
        note(
            f"NATS (embedded, pid {proc.pid}) exited with {code} at {time.strftime('%H:%M:%S')}; "
            f"restarting it on {self.url} with its store"
        )
        down = time.monotonic()
        try:
            # The port still held, say: try again shortly (0.5 s doubling up to 2 s, plus jitter).
            async for attempt in retrying(
                NatsServerFailed, None, wait_initial=0.5, wait_max=2.0, attempts=RESTART_ATTEMPTS
            ):
                with attempt:
                    self.server.proc = None
                    await asyncio.to_thread(self.server.start)
        except NatsServerFailed as err:
            raise RunFailed(f"the embedded NATS server could not be restarted: {err}") from None
        self.restarts += 1
        note(f"NATS back after {time.monotonic() - down:.1f}s (pid {self.server.pid}), restart {self.restarts}")


def read_env_file(path: Path) -> dict[str, str]:
    """`KEY=VALUE` lines (comments and blank lines skipped), as `relax auth` writes them."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def settings_from_env(env: dict[str, str], nats_url: str) -> ConnectionSettings:
    """`ConnectionSettings` from RELAX_* variables (a `<role>.env`), connecting to `nats_url`."""
    prefix = str(ConnectionSettings.model_config.get("env_prefix", "")).upper()
    fields = {k[len(prefix) :].lower(): v for k, v in env.items() if k.startswith(prefix)}
    return ConnectionSettings(**{**fields, "nats_url": [nats_url]})


def serve_run_dir(run_dir: Path) -> tuple[EmbeddedServer, ConnectionSettings]:
    """A started server on the store of a `relax run` that has ended, and how its admin connects.

    The run's streams live in its own account (`relax_bus.ops.credentials`), so the store is served with
    the run's users again (`<run dir>/auth`); a store written without them is served as it was."""
    auth = run_dir / "auth"
    conf = auth / "nats-server.conf"
    server = EmbeddedServer(store_dir=run_dir / "nats", config_file=conf if conf.is_file() else None).start()
    admin = auth / "admin.env"
    env = read_env_file(admin) if conf.is_file() and admin.is_file() else {}
    return server, settings_from_env(env, server.url)

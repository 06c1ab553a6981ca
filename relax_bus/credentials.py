"""The files `relax auth` writes: a nats-server config, its users, and one credentials file per role.

`auth.conf` holds an `authorization` block with one user per role (`relax_bus.auth.permissions`)
and can be included in any server config; `nats-server.conf` runs a loopback JetStream server with
it. Passwords are random (`secrets.token_urlsafe`) and stored as bcrypt hashes, which nats-server
accepts in their place, made with the C library's bcrypt through Python's `crypt` module. Where the
C library has no bcrypt (macOS), auth.conf holds the passwords themselves and `Bundle.hashed` says
so. Each `<role>.env` holds the RELAX_* variables `ConnectionSettings` reads. Every file is 0600.
"""

from __future__ import annotations

import os
import secrets
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from relax_bus.auth import inbox_prefix, permissions, user_name, users
from relax_bus.errors import CredentialsExist
from relax_bus.settings import ConnectionSettings, RunConfig
from relax_bus.topology import Topology, build_topology

BCRYPT_LOG_ROUNDS = 11  # the NATS CLI's default cost: ~0.1 s per connection, paid by the server


@dataclass(frozen=True)
class Credentials:
    """One user's name, password and reply prefix: what a role's process is started with."""

    role: str
    user: str
    password: str
    inbox_prefix: str

    def env(self, nats_url: str, tls_ca_file: Path | None = None) -> dict[str, str]:
        """The RELAX_* variables that make `ConnectionSettings` connect as this user."""
        values = {"nats_url": nats_url, "user": self.user, "password": self.password, "inbox_prefix": self.inbox_prefix}
        if tls_ca_file is not None:
            values["tls_ca_file"] = str(tls_ca_file)
        prefix = str(ConnectionSettings.model_config.get("env_prefix", ""))
        return {f"{prefix}{k}".upper(): v for k, v in values.items()}


@dataclass
class Bundle:
    """What `write_bundle` wrote."""

    out: Path
    server_conf: Path
    auth_conf: Path
    nats_url: str
    hashed: bool
    """Whether auth.conf holds bcrypt hashes (else the passwords themselves)."""
    credentials: dict[str, Credentials] = field(default_factory=dict)
    env_files: dict[str, Path] = field(default_factory=dict)


def bcrypt_hash(password: str) -> str | None:
    """A bcrypt hash nats-server accepts in place of `password`; None where the C library has no bcrypt."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import crypt  # stdlib up to Python 3.12 (this project's range); bcrypt comes from libcrypt
        except ImportError:
            return None
    if crypt.METHOD_BLOWFISH not in crypt.methods:
        return None
    hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << BCRYPT_LOG_ROUNDS))
    return hashed if hashed and hashed.startswith("$2") else None


def _q(text: str | Path) -> str:
    """A double-quoted string in nats-server's config syntax (quoted, so `$` is no variable)."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _list(items: tuple[str, ...], indent: str) -> str:
    return "[\n" + "".join(f"{indent}  {_q(i)}\n" for i in items) + f"{indent}]"


def auth_conf(topology: Topology, secrets_by_role: dict[str, tuple[str, str]]) -> str:
    """The `authorization` block: role -> (user, password or bcrypt hash)."""
    blocks = []
    for role, (user, secret) in secrets_by_role.items():
        p = permissions(topology, role)
        blocks.append(
            f"    {{ # {role}\n      user: {_q(user)}\n      password: {_q(secret)}\n      permissions: {{\n"
            f"        publish: {{ allow: {_list(p.publish, '        ')} }}\n"
            f"        subscribe: {{ allow: {_list(p.subscribe, '        ')} }}\n      }}\n    }}"
        )
    return (
        f"# Users of run {topology.run}, one per role, written by `relax auth`; include it in a server config.\n"
        "authorization {\n  users = [\n" + "\n".join(blocks) + "\n  ]\n}\n"
    )


def server_conf(host: str, port: int, store_dir: Path | None, tls: tuple[Path, Path] | None) -> str:
    """A runnable nats-server config: JetStream, loopback by default, the users from auth.conf.

    Without `store_dir` the store comes from the server's `-sd` flag (or its default).
    """
    lines = [
        "# nats-server -c nats-server.conf   (written by `relax auth`)",
        f"listen: {_q(f'{host}:{port}')}",
        f"jetstream {{ store_dir: {_q(store_dir)} }}" if store_dir else "jetstream: enabled",
    ]
    if tls is not None:
        lines.append(f"tls {{ cert_file: {_q(tls[0])}, key_file: {_q(tls[1])} }}")
    return "\n".join([*lines, "include ./auth.conf", ""])


def write_bundle(
    config: RunConfig,
    out: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 4222,
    store_dir: Path | None = Path(".relax/nats"),
    tls: tuple[Path, Path] | None = None,
    tls_ca_file: Path | None = None,
    force: bool = False,
) -> Bundle:
    """Write nats-server.conf, auth.conf and <role>.env (mode 0600) for every user of the run.

    Fresh random passwords each time; refuses (CredentialsExist) to replace files unless `force`.
    """
    t = build_topology(config)
    roles = users(t)
    bundle = Bundle(
        out=out,
        server_conf=out / "nats-server.conf",
        auth_conf=out / "auth.conf",
        nats_url=f"{'tls' if tls else 'nats'}://{host}:{port}",
        hashed=True,
        env_files={role: out / f"{role}.env" for role in roles},
    )
    taken = [p for p in (bundle.server_conf, bundle.auth_conf, *bundle.env_files.values()) if p.exists()]
    if taken and not force:
        names = ", ".join(p.name for p in taken)
        raise CredentialsExist(f"{out} already holds {names}: pass --force to replace them (and restart every role)")
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    stored: dict[str, tuple[str, str]] = {}
    for role in roles:
        cred = Credentials(role, user_name(t.run, role), secrets.token_urlsafe(24), inbox_prefix(t.run, role))
        bundle.credentials[role] = cred
        hashed = bcrypt_hash(cred.password)
        bundle.hashed = bundle.hashed and hashed is not None
        stored[role] = (cred.user, hashed or cred.password)
    tls = (tls[0].resolve(), tls[1].resolve()) if tls else None
    _write_private(bundle.server_conf, server_conf(host, port, store_dir.resolve() if store_dir else None, tls))
    _write_private(bundle.auth_conf, auth_conf(t, stored))
    ca = tls_ca_file.resolve() if tls_ca_file else None
    for role, cred in bundle.credentials.items():
        header = f"# NATS credentials of the {role} of run {t.run} (user {cred.user}), written by `relax auth`.\n"
        body = "".join(f"{k}={v}\n" for k, v in cred.env(bundle.nats_url, ca).items())
        _write_private(bundle.env_files[role], header + body)
    return bundle


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (0600, also when it existed with a wider mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)

"""The files `relax auth` writes: a nats-server config, its users, and one credentials file per role.

`auth.conf` holds the run's account: one user per role (`relax_bus.ops.auth.permissions`) and the account's
JetStream limits (`relax_bus.ops.server_conf`); it can be included in any server config, and
`nats-server.conf` runs a JetStream server with it (loopback by default: another address needs TLS, or
an explicit `allow_plaintext`). A user logs in with a password or with an nkey:

    password  random (`secrets.token_urlsafe`), stored as a bcrypt hash (the `bcrypt` package), which
              nats-server accepts in its place: auth.conf never holds a password
    nkey      an ed25519 key pair (the `nkeys` package): auth.conf names the public key (`U...`), the
              role keeps the seed in `<role>.nk`; the server checks a signature of a random nonce, so
              no secret crosses the network, even without TLS

Each `<role>.env` holds the RELAX_* variables `ConnectionSettings` reads (with `role_dirs`, in
`<out>/<role>/`, so each role can be handed its own directory and nothing else). A cluster's route
credentials go to `cluster.conf`. Every file is 0600.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from relax_bus.errors import ConfigError, CredentialsExist
from relax_bus.ops.auth import inbox_prefix, permissions, user_name, users
from relax_bus.ops.server_conf import (
    DEFAULT_MAX_PAYLOAD,
    Cluster,
    JetStreamLimits,
    account_jetstream,
    check_payload,
    cluster_conf,
    is_loopback,
    q,
    server_conf,
    split_host_port,
)
from relax_bus.settings import ConnectionSettings, RunConfig
from relax_bus.topology import Topology, build_topology

BCRYPT_LOG_ROUNDS = 11  # the NATS CLI's default cost: ~0.1 s per connection, paid by the server
ROUTE_USER = "route"


@dataclass(frozen=True)
class Credentials:
    """One user's name, secret and reply prefix: what a role's process is started with.

    A password user has `password`; an nkey user has `seed_file` (its seed) and an empty password."""

    role: str
    user: str
    password: str
    inbox_prefix: str
    seed_file: Path | None = None

    def env(self, nats_url: str, tls_ca_file: Path | None = None) -> dict[str, str]:
        """The RELAX_* variables that make `ConnectionSettings` connect as this user."""
        values = {"nats_url": nats_url}
        if self.seed_file is None:
            values |= {"user": self.user, "password": self.password}
        else:
            values["nkey_seed_file"] = str(self.seed_file)
        values["inbox_prefix"] = self.inbox_prefix
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
    credentials: dict[str, Credentials] = field(default_factory=dict)
    env_files: dict[str, Path] = field(default_factory=dict)
    seed_files: dict[str, Path] = field(default_factory=dict)
    """role -> its `<role>.nk` (nkey logins only)."""
    cluster_conf: Path | None = None
    """The route credentials and routes (only when a cluster was given)."""

    def files(self) -> list[Path]:
        """Every file the bundle consists of."""
        extra = [self.cluster_conf] if self.cluster_conf else []
        return [self.server_conf, self.auth_conf, *extra, *self.env_files.values(), *self.seed_files.values()]


def bcrypt_hash(password: str) -> str:
    """A bcrypt hash (`$2b$11$...`) nats-server accepts in place of `password`."""
    import bcrypt

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=BCRYPT_LOG_ROUNDS)).decode()


def nkey_user() -> tuple[str, str]:
    """A new nkey user: its seed (`SU...`, the secret) and its public key (`U...`, what the server names)."""
    import nkeys  # type: ignore[import-untyped]

    seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
    pair = nkeys.from_seed(bytearray(seed))
    try:
        return seed.decode(), pair.public_key.decode()
    finally:
        pair.wipe()


def _list(items: tuple[str, ...], indent: str) -> str:
    return "[\n" + "".join(f"{indent}  {q(i)}\n" for i in items) + f"{indent}]"


def auth_conf(
    topology: Topology,
    secrets_by_role: dict[str, tuple[str, str]],
    *,
    nkeys: dict[str, str] | None = None,
    limits: JetStreamLimits | None = None,
) -> str:
    """The run's account: its JetStream limits (default `JetStreamLimits.for_run`) and its users.

    `secrets_by_role`: role -> (user, password or bcrypt hash); `nkeys`: role -> public nkey, for users
    that log in with a seed instead."""
    blocks = []
    logins = [(role, f"user: {q(user)}, password: {q(secret)}") for role, (user, secret) in secrets_by_role.items()]
    logins += [(role, f"nkey: {q(public)}") for role, public in (nkeys or {}).items()]
    for role, login in logins:
        p = permissions(topology, role)
        blocks.append(
            f"      {{ # {role}\n        {login}\n        permissions: {{\n"
            f"          publish: {{ allow: {_list(p.publish, '          ')} }}\n"
            f"          subscribe: {{ allow: {_list(p.subscribe, '          ')} }}\n"
            + ("          allow_responses: true\n" if p.allow_responses else "")
            + "        }\n      }"
        )
    limits = limits or JetStreamLimits.for_run(topology)
    return (
        f"# The account of run {topology.run}: one user per role, written by `relax auth`; include it in a\n"
        "# server config. Its JetStream limits bound what the run may store, whoever's credentials leak.\n"
        f"accounts {{\n  {q(f'RELAX_{topology.run}')}: {{\n    {account_jetstream(limits)}\n"
        "    users = [\n" + "\n".join(blocks) + "\n    ]\n  }\n}\n"
    )


def check_exposure(
    host: str, tls: tuple[Path, Path] | None, cluster: Cluster | None, allow_plaintext: bool, nkeys: bool = False
) -> list[str]:
    """Listeners beyond loopback without TLS: ConfigError unless `allow_plaintext`, else one warning each.

    Routes have no TLS here, so a route listener beyond loopback always counts."""
    exposed, warnings = [], []
    if not is_loopback(host) and tls is None:
        exposed.append(f"clients on {host}")
        login = "the nkey logins do not" if nkeys else "so do the passwords (--nkeys keeps logins off the wire)"
        warnings.append(f"clients on {host} without TLS: messages cross the network in clear, and {login}")
    if cluster is not None and not is_loopback(split_host_port(cluster.listen, "--cluster-listen")[0]):
        exposed.append(f"routes on {cluster.listen}")
        warnings.append(f"routes on {cluster.listen} without TLS: the route password and messages cross it in clear")
    if exposed and not allow_plaintext:
        fix = "give --tls-cert/--tls-key or listen on 127.0.0.1; " if not is_loopback(host) and tls is None else ""
        raise ConfigError(
            "relax auth flags",
            [
                f"{' and '.join(exposed)} would carry credentials and messages in clear, without TLS: "
                f"{fix}pass --allow-plaintext on a private network"
            ],
        )
    return warnings


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
    allow_plaintext: bool = False,
    nkeys: bool = False,
    client_url: str | None = None,
    role_dirs: bool = False,
    limits: JetStreamLimits | None = None,
    max_payload: int | None = None,
    monitor_port: int | None = None,
    cluster: Cluster | None = None,
) -> Bundle:
    """Write nats-server.conf, auth.conf and <role>.env (mode 0600) for every user of the run.

    Fresh random secrets each time; refuses (CredentialsExist) to replace files unless `force`, and
    (ConfigError) a listener beyond loopback without TLS unless `allow_plaintext`. `nkeys`: the users
    log in with `<role>.nk` seeds instead of passwords. `client_url`: the URL(s) written into the
    `.env` files (default: from host and port). `max_payload` defaults to 1 MiB, or the run's largest
    message (`bus.max_msg_bytes`) when that is more.
    """
    t = build_topology(config)
    check_exposure(host, tls, cluster, allow_plaintext, nkeys)
    largest = config.bus.msg_bytes_limit
    max_payload = max_payload or max(DEFAULT_MAX_PAYLOAD, largest)
    check_payload(max_payload, largest)
    limits = limits or JetStreamLimits.for_run(t)
    roles = users(t)
    home = {role: out / role if role_dirs else out for role in roles}
    bundle = Bundle(
        out=out,
        server_conf=out / "nats-server.conf",
        auth_conf=out / "auth.conf",
        nats_url=client_url or f"{'tls' if tls else 'nats'}://{host}:{port}",
        env_files={role: home[role] / f"{role}.env" for role in roles},
        seed_files={role: home[role] / f"{role}.nk" for role in roles} if nkeys else {},
        cluster_conf=out / "cluster.conf" if cluster else None,
    )
    taken = [p for p in bundle.files() if p.exists()]
    if taken and not force:
        names = ", ".join(str(p.relative_to(out)) for p in taken)
        raise CredentialsExist(f"{out} already holds {names}: pass --force to replace them (and restart every role)")
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    for d in set(home.values()) - {out}:
        d.mkdir(exist_ok=True, mode=0o700)
        d.chmod(0o700)
    stored: dict[str, tuple[str, str]] = {}
    public_keys: dict[str, str] = {}
    for role in roles:
        user, inbox = user_name(t.run, role), inbox_prefix(t.run, role)
        if nkeys:
            seed, public_keys[role] = nkey_user()
            seed_file = bundle.seed_files[role].resolve()
            _write_private(seed_file, seed + "\n")
            bundle.credentials[role] = Credentials(role, user, "", inbox, seed_file=seed_file)
        else:
            cred = Credentials(role, user, secrets.token_urlsafe(24), inbox)
            bundle.credentials[role] = cred
            stored[role] = (cred.user, bcrypt_hash(cred.password))
    tls = (tls[0].resolve(), tls[1].resolve()) if tls else None
    ca = tls_ca_file.resolve() if tls_ca_file else None
    for role, cred in bundle.credentials.items():
        header = f"# NATS credentials of the {role} of run {t.run} (user {cred.user}), written by `relax auth`.\n"
        body = "".join(f"{k}={v}\n" for k, v in cred.env(bundle.nats_url, ca).items())
        _write_private(bundle.env_files[role], header + body)
    _write_private(bundle.auth_conf, auth_conf(t, stored, nkeys=public_keys, limits=limits))
    if cluster is not None and bundle.cluster_conf is not None:
        _write_private(bundle.cluster_conf, cluster_conf(cluster, ROUTE_USER, secrets.token_urlsafe(24)))
    # Last: a server (or container) that waits for nats-server.conf finds what it includes complete.
    store = store_dir.resolve() if store_dir else None
    conf = server_conf(
        host,
        port,
        store,
        tls,
        limits=limits,
        max_payload=max_payload,
        monitor_port=monitor_port,
        cluster=cluster is not None,
    )
    _write_private(bundle.server_conf, conf)
    return bundle


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (0600, also when it existed with a wider mode), atomically:
    a reader sees the old file or the whole new one.

    The new text goes to a fresh file of a random name (`mkstemp`: O_CREAT | O_EXCL, mode 0600), never to a
    fixed `.part` name another local user could have planted as a symlink in a shared directory; the
    rename replaces `path` itself, a symlink there included, without following it."""
    fd, part = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(part, path)
    except BaseException:
        os.unlink(part)
        raise

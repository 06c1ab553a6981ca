"""The server side of `relax auth` against real nats-servers: no plaintext listener beyond loopback unless
asked for, account limits and payload bound, nkey logins, authenticated cluster routes, `relax server
--auth`, and the compose files that wire them up (validated, and their `relax auth` lines run here)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import nkeys
import pytest
import yaml

from relax_bus.connection import connect
from relax_bus.errors import ConfigError, NatsServerNotFound, NatsUnreachable
from relax_bus.ops.cli import COMMANDS, build_parser
from relax_bus.ops.credentials import nkey_user, write_bundle
from relax_bus.ops.server import EmbeddedServer, free_port, wait_for_port
from relax_bus.ops.server_conf import (
    FILE_HEADROOM,
    MEMORY_HEADROOM,
    UNBOUNDED_STORE_ALLOWANCE,
    Cluster,
    JetStreamLimits,
    cluster_conf,
    reservations,
)
from relax_bus.provision import provision
from relax_bus.settings import ConnectionSettings, RunConfig
from relax_bus.topology import build_topology
from tests.bus.test_auth import server_from
from tests.bus.test_tls import self_signed
from tests.cli.test_cli import assert_one_line_error, relax, write_config
from tests.conftest import REQUIRE_NATS, run_config
from tests.container_host import NATS_IMAGE, missing
from tests.nats_cluster import NatsCluster
from tests.waiting import until

ROOT = Path(__file__).resolve().parents[2]
BASE, CLUSTER, AUTH = (ROOT / f"docker-compose{x}.yml" for x in ("", ".cluster", ".auth"))
ROLES = ("feeder", "rollout", "reward", "actor", "metrics")


def env_file(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def settings_of(env: Path, url: str, **update: Any) -> ConnectionSettings:
    """A role's settings as its process gets them: from its .env file, on the test server's URL."""
    s = ConnectionSettings(_env_file=env, nats_url=[url])  # type: ignore[call-arg]
    return s.model_copy(update=update) if update else s


# ---------------------------------------------------------------- 1. no plaintext beyond loopback


@pytest.mark.cli
def test_auth_refuses_a_public_plaintext_listener_unless_tls_or_allowed(tmp_path):
    cfg = write_config(tmp_path, "run: plain\n")
    out = tmp_path / "auth"
    refused = relax("auth", cfg, "--out", str(out), "--host", "0.0.0.0")
    assert_one_line_error(refused, "clients on 0.0.0.0", "without TLS", "--tls-cert", "--allow-plaintext")
    assert not out.exists(), "nothing is written when refused"
    allowed = relax("auth", cfg, "--out", str(out), "--host", "0.0.0.0", "--allow-plaintext")
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stderr.startswith("relax: warning: clients on 0.0.0.0 without TLS"), allowed.stderr
    assert 'listen: "0.0.0.0:4222"' in (out / "nats-server.conf").read_text()

    config = run_config()
    ca, cert, key = self_signed(tmp_path)
    write_bundle(config, tmp_path / "tls", host="0.0.0.0", tls=(cert, key), tls_ca_file=ca)  # TLS: allowed
    write_bundle(config, tmp_path / "local", host="127.0.0.1")
    routes = Cluster(("10.0.0.2:6222",), listen="0.0.0.0:6222")
    with pytest.raises(ConfigError, match=r"routes on 0\.0\.0\.0:6222 would carry credentials"):
        write_bundle(config, tmp_path / "routes", tls=(cert, key), cluster=routes)  # routes have no TLS here
    write_bundle(config, tmp_path / "routes", cluster=routes, allow_plaintext=True)


# ---------------------------------------------------------------- 2. account limits, payload, monitoring


@pytest.mark.bus
async def test_the_account_limits_are_finite_even_with_an_unbounded_weights_store(tmp_path):
    """`bus.weights_max_bytes` null left the account's file storage unbounded (-1): the trainer's credentials
    could fill the server's disk. The default limit is now the run's reservations plus a stated allowance."""
    config = run_config()
    assert config.bus.weights_max_bytes is None
    t = build_topology(config)
    reserved = reservations(t)
    limits = JetStreamLimits.for_run(t)
    assert limits.max_file == reserved["file"] + UNBOUNDED_STORE_ALLOWANCE + FILE_HEADROOM
    assert limits.max_memory == reserved["memory"] + MEMORY_HEADROOM
    bounded = build_topology(run_config(bus={"weights_max_bytes": 1 << 30, "checkpoints_max_bytes": 1 << 30}))
    assert JetStreamLimits.for_run(bounded).max_file == reservations(bounded)["file"] + FILE_HEADROOM
    assert reserved["file"] >= config.bus.state_max_bytes + config.bus.workers_max_bytes  # buckets count too

    bundle = write_bundle(config, tmp_path / "auth", store_dir=None)
    conf = bundle.server_conf.read_text()
    assert f"max_file_store: {limits.max_file}" in conf and "-1" not in (tmp_path / "auth" / "auth.conf").read_text()
    server = server_from(bundle, tmp_path / "nats")
    try:
        nc = await connect(settings_of(bundle.env_files["admin"], server.url), name="admin")
        try:
            info = await nc.jetstream(timeout=10.0).account_info()
            assert (info.limits.max_storage, info.limits.max_memory) == (limits.max_file, limits.max_memory)
        finally:
            await nc.close()
    finally:
        server.cleanup()


@pytest.mark.bus
async def test_the_run_account_has_jetstream_limits_and_the_server_a_payload_bound(tmp_path):
    config = run_config()
    t = build_topology(config)
    reserved = reservations(t)["file"]
    limits = JetStreamLimits.for_run(t, max_file=reserved + (64 << 20), max_streams=15, max_consumers=80)
    bundle = write_bundle(config, tmp_path / "auth", store_dir=None, limits=limits)
    conf = bundle.server_conf.read_text()
    assert "max_payload: 1048576" in conf and "\nhttp" not in conf, conf  # monitoring off
    server = server_from(bundle, tmp_path / "nats")
    try:
        nc = await connect(settings_of(bundle.env_files["admin"], server.url), name="admin")
        try:
            assert nc.max_payload == 1 << 20
            js = nc.jetstream(timeout=10.0)
            report = await provision(js, config)
            assert len(report.created) == 15 + len(t.consumers)
            info = await js.account_info()
            got = (info.limits.max_memory, info.limits.max_storage, info.limits.max_streams, info.limits.max_consumers)
            assert got == (limits.max_memory, limits.max_file, 15, 80)
            train = await js.stream_info(t.stream("train").name)
            train.config.max_bytes = (train.config.max_bytes or 0) + (128 << 20)  # past the account's file limit
            with pytest.raises(nats.js.errors.APIError, match=r"insufficient (storage )?resources"):
                await js.update_stream(train.config)
        finally:
            await nc.close()
    finally:
        server.cleanup()

    with pytest.raises(ConfigError, match=r"--max-consumers 40 is below the 64 each stream of the run accepts"):
        JetStreamLimits.for_run(t, max_consumers=40)
    with pytest.raises(ConfigError, match=r"below the \d+ bytes .* the run's streams and stores reserve"):
        JetStreamLimits.for_run(t, max_file=reserved - 1)
    with pytest.raises(ConfigError, match=r"--max-payload 500000 is below the run's largest message, 589824 bytes"):
        write_bundle(config, tmp_path / "small", max_payload=500_000)
    big = run_config(bus={"claim_check_bytes": 4 << 20})
    assert "max_payload: 4259840" in write_bundle(big, tmp_path / "big").server_conf.read_text()

    port = free_port()
    watched = write_bundle(config, tmp_path / "watched", store_dir=None, monitor_port=port)
    assert f'http: "127.0.0.1:{port}"' in watched.server_conf.read_text()
    server = server_from(watched, tmp_path / "nats-watched")
    try:
        wait_for_port("127.0.0.1", port, 10)
        answer = await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{port}/healthz", timeout=5)
        with answer:
            assert answer.status == 200
    finally:
        server.cleanup()


# ---------------------------------------------------------------- 3. nkey logins and login files


@pytest.mark.bus
async def test_nkey_logins_work_and_a_wrong_seed_or_bad_file_is_refused(tmp_path):
    config = run_config()
    bundle = write_bundle(config, tmp_path / "auth", store_dir=None, nkeys=True, role_dirs=True)
    assert "password" not in bundle.auth_conf.read_text() and 'nkey: "U' in bundle.auth_conf.read_text()
    for role, env in bundle.env_files.items():
        assert env.parent == bundle.out / role and env.parent.stat().st_mode & 0o777 == 0o700
        values = env_file(env)
        assert values["RELAX_NKEY_SEED_FILE"] == str(bundle.seed_files[role].resolve())
        assert "RELAX_PASSWORD" not in values and bundle.seed_files[role].read_text().startswith("SU")
        assert bundle.seed_files[role].stat().st_mode & 0o777 == 0o600
    server = server_from(bundle, tmp_path / "nats")
    try:
        admin = settings_of(bundle.env_files["admin"], server.url)
        nc = await connect(admin, name="admin")
        try:
            assert len((await provision(nc.jetstream(timeout=10.0), config)).created) == 19
        finally:
            await nc.close()
        wrong = tmp_path / "wrong.nk"
        wrong.write_text(nkey_user()[0] + "\n")  # a valid seed, but no user of this server
        with pytest.raises(NatsUnreachable, match="Authorization Violation"):
            await connect(admin.model_copy(update={"nkey_seed_file": wrong}), name="wrong-seed")
    finally:
        server.cleanup()

    missing_seed, garbage = tmp_path / "gone.nk", tmp_path / "garbage.nk"
    garbage.write_text("SUnot-a-seed\n")
    account_seed = tmp_path / "account.nk"
    account_seed.write_text(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT).decode() + "\n")
    not_creds = tmp_path / "user.creds"
    not_creds.write_text("just text\n")
    cases = [
        ({"nkey_seed_file": missing_seed}, f"RELAX_NKEY_SEED_FILE {missing_seed}: No such file"),
        ({"nkey_seed_file": garbage}, f"RELAX_NKEY_SEED_FILE {garbage}: no valid nkey seed"),
        ({"nkey_seed_file": account_seed}, "is not a user's"),
        ({"creds_file": tmp_path / "gone.creds"}, f"RELAX_CREDS_FILE {tmp_path / 'gone.creds'}: No such file"),
        ({"creds_file": not_creds}, f"RELAX_CREDS_FILE {not_creds}: not a NATS credentials file"),
    ]
    for update, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            await connect(ConnectionSettings(nats_url=["nats://127.0.0.1:1"], **update))


# ---------------------------------------------------------------- 4. authenticated cluster routes


@pytest.mark.bus
async def test_cluster_routes_need_the_route_password(tmp_path):
    try:
        cluster = NatsCluster(tmp_path / "cluster", route_auth=("route", "r0ute-pa55word"))
    except NatsServerNotFound as err:
        if REQUIRE_NATS:
            pytest.fail(str(err))
        pytest.skip(str(err))
    intruder: EmbeddedServer | None = None
    try:
        cluster.start()
        assert "r0ute-pa55word" in (tmp_path / "cluster" / "n1.conf").read_text()
        logs = [s.log_file for s in cluster.servers.values()]
        await until(
            lambda: [p.read_text(errors="replace") for p in logs],
            lambda texts: any("metadata leader" in t for t in texts),
            30,
            "a JetStream meta leader (the servers talk over the authenticated routes)",
        )
        nc = await nats.connect(cluster.urls)
        try:
            js = nc.jetstream(timeout=10.0)

            async def add_routed_stream() -> object:
                # A fresh cluster can elect its meta leader before every peer has caught up, and the first
                # R3 create then times out: retried, as provisioning a run does; expiry names the last error.
                try:
                    return await js.add_stream(name="ROUTED", subjects=["routed.>"], num_replicas=3)
                except (nats.errors.Error, TimeoutError) as err:
                    return err

            info = await until(
                add_routed_stream,
                lambda r: not isinstance(r, Exception),
                60,
                "an R3 stream created over the authenticated routes",
            )
            assert len(info.cluster.replicas) == 2  # type: ignore[attr-defined]  # a copy on each other server
        finally:
            await nc.close()

        # A server that knows the route port but not the password is refused.
        conf = tmp_path / "intruder.conf"
        conf.write_text(
            f"server_name: intruder\ncluster {{ name: relax, listen: 127.0.0.1:{free_port()}, "
            f"routes: [nats-route://127.0.0.1:{cluster.routes[0]}] }}\n"
        )
        intruder = EmbeddedServer(store_dir=tmp_path / "intruder", config_file=conf).start()
        seen = await until(
            lambda: intruder.log_file.read_text(errors="replace") if intruder else "",
            lambda log: "Route Error 'Authorization Violation'" in log,
            30,
            "the intruder's refused route",
        )
        assert "Route Error 'Authorization Violation'" in seen
    finally:
        if intruder is not None:
            intruder.cleanup()
        cluster.cleanup()
    text = cluster_conf(Cluster(("a:6222", "b:6222")), "route", "pw")
    assert 'authorization { user: "route", password: "pw" }' in text and "nats-route://route:pw@b:6222" in text


# ---------------------------------------------------------------- 5. relax server --auth


@pytest.mark.cli
async def test_relax_server_runs_a_relax_auth_bundle(tmp_path):
    def refused(*args: str) -> str:
        """The error (`relax: error: ...`, exit 2) of `relax ARGS`, refused before anything starts."""
        parsed = build_parser()[0].parse_args(list(args))
        with pytest.raises(ConfigError) as err:
            COMMANDS[parsed.command](parsed, RunConfig)
        return str(err.value)

    assert "--host 0.0.0.0 without --auth" in refused("server", "--host", "0.0.0.0")
    out, port = tmp_path / "auth", free_port()
    write_bundle(run_config(), out, port=port, store_dir=tmp_path / "js", nkeys=True)
    assert "with --auth the bundle says" in refused("server", "--auth", str(out), "--port", "1")
    assert f"{tmp_path / 'nats-server.conf'}" in refused("server", "--auth", str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "server", "--auth", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        await asyncio.to_thread(wait_for_port, "127.0.0.1", port, 30, proc)  # type: ignore[arg-type]
        url = f"nats://127.0.0.1:{port}"
        with pytest.raises(NatsUnreachable, match="Authorization Violation"):
            await connect(ConnectionSettings(nats_url=[url]), name="anonymous")
        nc = await connect(settings_of(out / "admin.env", url), name="admin")
        try:
            assert (await nc.jetstream(timeout=10.0).account_info()).limits.max_streams == 32
        finally:
            await nc.close()
        assert (tmp_path / "js" / "jetstream").is_dir(), "the store is the one relax auth wrote"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert f"nats-server nats://127.0.0.1:{port}" in stdout and f"users of {out}" in stdout


# ---------------------------------------------------------------- 6. compose: authenticated mode and routes


def compose_config(*files: Path) -> dict[str, Any]:
    tool = shutil.which("docker-compose")
    if tool is None:
        missing("docker-compose is not installed (apt-get install docker-compose, or .ci/containers.sh)")
    args = [tool, "--project-directory", str(ROOT), *(a for f in files for a in ("-f", str(f))), "config"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]  # type: ignore[no-any-return]


def relax_auth_line(script: str, out: Path) -> list[str]:
    """The arguments of the `relax auth` in a compose service's shell script, its paths moved here."""
    text = script.replace("\\\n", " ").replace("$$", "$")
    line = next(line for line in text.splitlines() if "relax auth " in line)
    args = shlex.split(line.split("relax auth ", 1)[1])
    args[0] = str(ROOT / "examples" / Path(args[0]).name)
    args[args.index("--out") + 1] = str(out)
    return args


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """target -> 'volume:mode' of a resolved service."""
    found = {}
    for v in service.get("volumes", []):
        source, target, *mode = v.split(":") if isinstance(v, str) else (v["source"], v["target"])
        found[target] = f"{source}:{(mode or ['rw'])[0]}"
    return found


@pytest.mark.compose
def test_compose_auth_mode_hands_each_role_only_its_own_credentials(tmp_path):
    services = compose_config(BASE, AUTH)
    assert {"auth", "nats", "init", *ROLES, "reference", "inspect"} <= set(services), set(services)
    assert services["nats"]["image"] == NATS_IMAGE
    assert services["nats"]["command"] == ["-c", "/auth/nats-server.conf"]
    assert mounts(services["nats"])["/auth"] == "auth-server:ro"
    readers = [("init", "admin"), ("inspect", "observer"), ("reference", "reference"), *((r, r) for r in ROLES)]
    for name, role in readers:
        s = services[name]
        assert s["environment"]["AUTH_ROLE"] == role, name
        auth_mounts = {t: m for t, m in mounts(s).items() if t.startswith("/auth")}
        assert auth_mounts == {f"/auth/{role}": f"auth-{role}:ro"}, (name, auth_mounts)
    auth = services["auth"]
    assert mounts(auth)["/auth"] == "auth-server:rw"

    # The service's own `relax auth` line, run here: the files land where the mounts say.
    out = tmp_path / "auth"
    made = relax("auth", *relax_auth_line(auth["command"][0], out))
    assert made.returncode == 0, made.stderr
    assert "without TLS" in made.stderr  # --allow-plaintext on the project network, said out loud
    for role in ("admin", "observer", *ROLES):
        assert f"/auth/{role}" in mounts(auth), role
        values = env_file(out / role / f"{role}.env")
        assert values["RELAX_NATS_URL"] == "nats://nats:4222"
        assert values["RELAX_NKEY_SEED_FILE"] == str(out / role / f"{role}.nk")
    conf = (out / "nats-server.conf").read_text()
    assert 'listen: "0.0.0.0:4222"' in conf and 'store_dir: "/data"' in conf
    assert '\nhttp: "127.0.0.1:8222"' in conf  # monitoring for the healthcheck, on the container's loopback only


@pytest.mark.compose
def test_compose_cluster_routes_are_authenticated(tmp_path):
    services = compose_config(BASE, CLUSTER)
    servers = {n: s for n, s in services.items() if n.startswith("nats") and n != "nats-box"}
    assert set(servers) == {"nats", "nats-2", "nats-3"}
    for name, s in servers.items():
        assert s["image"] == NATS_IMAGE
        command = s["command"]
        assert command[:2] == ["-c", "/routes/cluster.conf"], (name, command)
        assert not {"--cluster", "--routes"} & set(command), "routes from flags would carry no password"
        assert mounts(s)["/routes"] == "nats-routes:ro"
        assert not any(":6222" in str(p) for p in s.get("ports", [])), s["ports"]
    out = tmp_path / "routes"
    made = relax("auth", *relax_auth_line(services["routes"]["command"][0], out))
    assert made.returncode == 0, made.stderr
    text = (out / "cluster.conf").read_text()
    password = re.search(r'password: "([^"]+)"', text)
    assert password and len(password.group(1)) >= 32, text
    for peer in ("nats", "nats-2", "nats-3"):
        assert f"nats-route://route:{password.group(1)}@{peer}:6222" in text


# ---------------------------------------------------------------- listeners stay where they are told


def listening_on(port: int) -> set[str]:
    """The local addresses of every TCP socket of this machine listening on `port` (from /proc/net/tcp{,6})."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            host, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(host)
            # The kernel prints each 32-bit word in host (little-endian) order.
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            out.add(str(ipaddress.ip_address(words)))
    return out


def test_the_broadcast_weights_store_listens_on_the_host_it_is_given_only():
    """torch's `TCPStore(host, ..., is_master=True)` listened on every interface even when given 127.0.0.1: any
    host that reached the port could join the rounds or write the store."""
    from workers.weights.broadcast import Sender

    sender = Sender("127.0.0.1", 0, timeout_s=5.0, bucket_mb=1, verify=False)
    try:
        assert listening_on(sender.address["port"]) == {"127.0.0.1"}
        sender.store.set("k", "v")  # and it serves
        assert sender.store.get("k") == b"v"
    finally:
        del sender

"""The trainer on several nodes: `trainer.distributed.nnodes` and torchrun's c10d rendezvous.

The whole runs put two "nodes" on this machine, two torchrun agents (`--nnodes=2 --nproc-per-node=1`)
that meet in one c10d rendezvous on 127.0.0.1 and train over gloo: either each is `relax worker actor
--run RUN`, as an operator starts it on every machine, which re-executes itself as a torchrun agent, or
they are the agents `relax run` starts itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.errors import ConfigError
from relax_bus.ops.server import free_port
from relax_bus.provision import provision_when_ready
from relax_bus.settings import ConnectionSettings
from tests.e2e.cluster import Cluster, small_config
from tests.waiting import until
from workers.config import PipelineConfig, parse_config
from workers.launch.processes import RunProcesses, role_commands
from workers.roles.torchrun import launcher, worker_arguments
from workers.training.distributed import check_world


def run_id() -> str:
    return f"mn{uuid.uuid4().hex[:8]}"


def node_command(url: str, run: str, work_dir: Path) -> list[str]:
    """What an operator runs on every node (options before the command, `--run` spelled short)."""
    options = ["--nats-url", url, "--run", run, "--work-dir", str(work_dir)]
    return [sys.executable, "-m", "workers.cli", "--log-level", "info", "worker", "actor", *options]


def log_events(path: Path, name: str) -> list[dict[str, Any]]:
    """The JSON log records named `name` in one process's log."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            record = json.loads(line)
            if record.get("event") == name:
                out.append(record)
    return out


@pytest.mark.unit
def test_nnodes_and_the_rendezvous_are_validated():
    ok = parse_config(
        small_config(run_id(), trainer={"distributed": {"nnodes": 2, "nproc": 2, "rdzv_endpoint": "10.0.0.1:29400"}})
    )
    assert ok.trainer.distributed.world_size == 4
    for trainer, needle in [
        ({"distributed": {"nnodes": 0}}, "nnodes"),
        ({"distributed": {"nnodes": 2, "rdzv_endpoint": "10.0.0.1"}}, "host:port"),
        ({"distributed": {"nnodes": 2, "rdzv_endpoint": "10.0.0.1:99999"}}, "host:port"),
        ({"distributed": {"rdzv_endpoint": "10.0.0.1:29400"}}, "set nnodes above 1"),
        ({"distributed": {"nnodes": 2, "rdzv_id": ""}}, "rdzv_id"),
    ]:
        with pytest.raises((ValidationError, ConfigError), match=needle):
            parse_config(small_config(run_id(), trainer=trainer))


@pytest.mark.unit
def test_relax_run_starts_one_torchrun_agent_per_node_at_one_rendezvous(tmp_path):
    config = parse_config(small_config(run_id(), trainer={"distributed": {"nnodes": 2}}))
    agents = [(i, cmd) for name, i, cmd in role_commands(config, "nats://127.0.0.1:4222", tmp_path) if name == "actor"]
    assert [i for i, _ in agents] == [0, 1]
    flags = [[a for a in cmd if a.startswith("--rdzv") or a.startswith("--n")] for _, cmd in agents]
    assert flags[0] == flags[1], flags
    endpoint = next(a for a in flags[0] if a.startswith("--rdzv-endpoint="))
    assert endpoint.startswith("--rdzv-endpoint=127.0.0.1:"), endpoint
    assert set(flags[0]) >= {"--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-id={config.run}"}
    assert "--standalone" not in agents[0][1]


@pytest.mark.unit
def test_a_node_needs_an_endpoint_and_keeps_its_arguments():
    config = parse_config(small_config(run_id(), trainer={"distributed": {"nnodes": 2}}))
    with pytest.raises(ConfigError, match=r"trainer\.distributed\.rdzv_endpoint"):
        launcher(config, 1, 2, None)
    args = worker_arguments(["--log-level", "info", "worker", "actor", "--run", "r1", "--work-dir", "w"])
    assert args == ["worker", "actor", "--log-level", "info", "--run-id", "r1", "--work-dir", "w"]
    assert worker_arguments(["worker", "actor", "--run=r1"]) == ["worker", "actor", "--run-id=r1"]


@pytest.mark.unit
def test_a_trainer_configured_for_two_nodes_refuses_a_world_of_one():
    config = parse_config(small_config(run_id(), trainer={"distributed": {"nnodes": 2, "nproc": 2}}))
    with pytest.raises(ConfigError, match=r"world of 1 ranks.*2 x 2 = 4"):
        check_world(SimpleNamespace(config=config))  # type: ignore[arg-type]


@pytest.mark.bus
@pytest.mark.timeout(120)
async def test_a_node_without_an_endpoint_refuses_in_one_line(nats_server, tmp_path):
    config = parse_config(small_config(run_id(), trainer={"distributed": {"nnodes": 2}}))
    nc = await connect(ConnectionSettings(nats_url=[nats_server.url]), name="test")
    try:
        await provision_when_ready(nc.jetstream(), config, wait_s=30.0)
    finally:
        await nc.close()
    done = subprocess.run(
        node_command(nats_server.url, config.run, tmp_path), capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "trainer.distributed.rdzv_endpoint" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.e2e
@pytest.mark.timeout(420)
@pytest.mark.parametrize("start", ["relax-worker-on-each-node", "relax-run-agents"])
async def test_trainer_on_two_nodes_trains_a_run_through_one_c10d_rendezvous(nats_server, tmp_path, start):
    """`relax-worker-on-each-node`: the endpoint in the config, each node the plain `relax worker actor`;
    `relax-run-agents`: no endpoint, the torchrun agents `relax run` starts on one machine."""
    trainer: dict[str, Any] = {"steps": 4, "distributed": {"nnodes": 2}}
    if start == "relax-worker-on-each-node":
        trainer["distributed"]["rdzv_endpoint"] = f"127.0.0.1:{free_port()}"
    config = parse_config(small_config(run_id(), trainer=trainer))
    url, work = nats_server.url, tmp_path / "cache"
    nc = await connect(ConnectionSettings(nats_url=[url]), name="e2e")
    await provision_when_ready(nc.jetstream(), config, wait_s=30.0)
    processes = RunProcesses(config, url, work, tmp_path / "logs")
    nodes = [r for r in processes.roles if r.name == "actor"]
    assert len(nodes) == 2
    if start == "relax-worker-on-each-node":
        for node in nodes:  # as on two machines: the plain command, which becomes a torchrun agent
            node.command = node_command(url, config.run, work)
    cluster = Cluster(url, config, tmp_path, processes, await Bus.attach(nc, config.run, PipelineConfig))
    processes.start()
    try:
        await cluster.wait_done()
        other = nodes[1].proc
        assert other is not None
        code = await until(other.poll, lambda c: c is not None, 120, f"node 1 exits ({nodes[1].log_path})")
        assert code == 0, cluster.log_tail(nodes[1])
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        assert [int(m.values["version"]) for m in acc.metrics] == [1, 2, 3, 4]
        # Both nodes took part: one agent's rank drove the run, the other's followed, in a world of two.
        drivers = [n for n in nodes if log_events(n.log_path, "driver_ready")]
        followers = [n for n in nodes if log_events(n.log_path, "follower_ready")]
        assert len(drivers) == 1 and len(followers) == 1 and drivers != followers, cluster.all_logs(40)
        (driver,) = log_events(drivers[0].log_path, "driver_ready")
        (follower,) = log_events(followers[0].log_path, "follower_ready")
        assert (driver["rank"], driver["world"], follower["rank"], follower["world"]) == (0, 2, 1, 2)
        assert driver["local_rank"] == follower["local_rank"] == 0  # one rank per node: each node's first
    finally:
        await cluster.stop()

"""A role checks the parts of the run's config it uses when it starts: one whose dataset is missing exits 2
with its one error, and the launcher's supervisor ends the run with that error instead of restarting it."""

from __future__ import annotations

import pytest

from relax_bus.connection import connect
from relax_bus.provision import provision
from relax_bus.settings import ConnectionSettings
from tests.conftest import run_config
from tests.waiting import holds, until
from workers.errors import RoleRefused
from workers.launch.processes import RunProcesses

pytestmark = [pytest.mark.bus, pytest.mark.timeout(120)]


async def test_a_role_refusing_its_config_exits_2_once_and_is_not_restarted(nats_server, tmp_path):
    missing = tmp_path / "no-such-data.jsonl"
    config = run_config(task={"type": "jsonl", "options": {"path": str(missing)}})
    nc = await connect(ConnectionSettings(nats_url=[nats_server.url]), name="test")
    try:
        await provision(nc.jetstream(), config)  # `relax init --no-check`: the run exists, its dataset does not
    finally:
        await nc.close()
    processes = RunProcesses(config, nats_server.url, tmp_path / "work", tmp_path / "logs")
    processes.roles = [processes.get("feeder")]  # the one role that reads the dataset and loads no model
    notes: list[str] = []

    def supervised() -> str | None:
        try:
            processes.supervise(notes.append)
        except RoleRefused as err:
            return str(err)
        return None

    processes.start()
    try:
        feeder = processes.get("feeder")
        refused = await until(supervised, lambda reason: reason is not None, 90, "the feeder refusing its config")
        assert feeder.proc is not None and feeder.proc.returncode == 2
        assert refused == (
            f"feeder-0 exited with 2 and is not restarted: invalid config run {config.run} (feeder) (1 problem(s)):\n"
            f"  - task: jsonl task file '{missing}' cannot be read: No such file or directory"
        )
        first = feeder.proc
        # Supervised again and again: the same reason each time, and never a second process.
        await holds(lambda: (supervised(), feeder.proc), lambda seen: seen == (refused, first), 1.0, "no restart")
        assert feeder.restarts == 0 and notes == [] and "Traceback" not in feeder.log_path.read_text()
    finally:
        processes.stop()

"""The bus against a nats-server container (testcontainers over Podman's Docker API), not the local binary.

The bus tier's own test bodies run here unchanged: each is bound below under its own name, so pytest
collects it again in this module, where `nats_server` is the container (tests/containers/conftest.py)
and the marker is `containers`. What the tier adds: the container runs the pinned server version, and
a message whose worker process was SIGKILLed reaches the next worker process through the container.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from relax_bus.envelope import CLAIM
from relax_bus.ops.server import find_nats_server
from schemas import PromptGroup
from tests import factories as f
from tests.bus import test_crash, test_publish, test_state, test_worker
from tests.bus.test_crash import start_worker, stop
from tests.bus.test_publish import read_all
from tests.bus.test_worker import consumer_state, echo, publish_prompts, rollout_worker
from tests.container_host import NATS_SERVER_VERSION
from tests.waiting import until

pytestmark = [
    pytest.mark.containers,
    # func_only: the module's container (and, on a cold host, its preparation) starts outside the 120 s bound.
    pytest.mark.timeout(120, func_only=True),
    # NatsContainer itself still waits through testcontainers' deprecated wait helpers.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:testcontainers"),
]

# Publish and consume through the durable work-queue consumer: outputs published, inputs acked.
test_handler_outputs_are_published_and_inputs_acked = test_worker.test_handler_outputs_are_published_and_inputs_acked
# The claim check: a payload above bus.claim_check_bytes goes to the object store and comes back intact,
# and the threshold never exceeds the container server's max_payload.
test_five_mib_payload_goes_through_the_claim_check = test_publish.test_five_mib_payload_goes_through_the_claim_check
test_oversized_payloads_fail_at_once_or_go_by_claim_check = (
    test_publish.test_oversized_payloads_fail_at_once_or_go_by_claim_check
)
# A worker process SIGKILLed with four messages in flight: the next worker gets all of them.
test_sigkill_with_messages_in_flight_loses_nothing = test_crash.test_sigkill_with_messages_in_flight_loses_nothing
# KV compare-and-set: the policy version refuses a stale write; concurrent counter writers lose nothing.
test_version_cas_refuses_a_stale_write = test_state.test_version_cas_refuses_a_stale_write
test_counter_compare_and_set_with_concurrent_writers = test_state.test_counter_compare_and_set_with_concurrent_writers


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


async def test_the_container_runs_the_pinned_nats_server(bus, nats_server):
    served = bus.nc.connected_server_version
    assert (served.major, served.minor, served.patch) == tuple(int(x) for x in NATS_SERVER_VERSION.split(".")), (
        f"{nats_server.image} serves {served}, the pin is {NATS_SERVER_VERSION}"
    )
    binary = subprocess.run([str(find_nats_server()), "--version"], capture_output=True, text=True, timeout=30)
    assert binary.stdout.strip() == f"nats-server: v{NATS_SERVER_VERSION}"  # what the bus tier runs


async def test_a_sigkilled_workers_message_is_redelivered_to_the_next_worker_process(make_bus, nats_server, tmp_path):
    bus = await make_bus(bus={"ack_wait_s": 2.0})
    await publish_prompts(bus, 1)
    first_log, next_log = tmp_path / "first.log", tmp_path / "next.log"
    first = start_worker(nats_server, bus.run, first_log, sleep=60)
    try:
        await until(lambda: _lines(first_log), lambda lines: lines == ["start g0 1"], what="the first delivery")
        os.kill(first.pid, signal.SIGKILL)
        assert first.wait(timeout=10) == -signal.SIGKILL
    finally:
        stop(first)

    successor = start_worker(nats_server, bus.run, next_log)
    try:
        # Redelivered after ack_wait (2 s), as the second delivery, and acked once its output is published.
        await until(lambda: _lines(next_log), lambda lines: "done g0" in lines, what="the redelivery's end")
        state = await until(
            lambda: consumer_state(bus),
            lambda s: s.num_pending == 0 and s.num_ack_pending == 0 and s.ack_floor.stream_seq == 1,
            what="the redelivered message acked",
        )
        os.kill(successor.pid, signal.SIGTERM)
        assert successor.wait(timeout=20) == 0
    finally:
        stop(successor)
    assert _lines(next_log) == ["start g0 2", "done g0"]
    assert [o.prompt.group_id for o in await read_all(bus, "rollouts")] == ["g0"]
    assert state.num_redelivered == 0 and state.delivered.consumer_seq == 2


async def test_a_claim_checked_input_reaches_the_handler_intact(bus):
    threshold = bus.publisher.claim_threshold
    big = f.prompt(bus.run, 0, text="z" * (threshold + 1))
    await bus.publish("prompts", big)
    raw = await bus.js.get_msg(bus.topology.stream("prompts").name, 1)
    assert CLAIM in raw.headers and not raw.data  # in the object store, not in the stream
    seen: list[PromptGroup] = []

    async def keep(prompt, delivery):
        seen.append(prompt)
        return await echo(prompt, delivery)

    counters = await rollout_worker(bus, keep).run(until_empty=True)
    assert counters.processed == 1 and seen == [big]
    assert [o.prompt for o in await read_all(bus, "rollouts")] == [big]

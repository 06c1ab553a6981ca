"""What `nats kv get` prints is readable: every KV value of a run is JSON text (a number is JSON too), and
`relax decode` turns the msgpack bodies of its streams into JSON.

The raw bytes are read the way the NATS CLI reads them (the entry's value, untouched), against a real
server. A heartbeat written as msgpack by a worker of a run started before heartbeats were JSON is
still read (`relax inspect` keeps listing that worker until it restarts).
"""

import asyncio
import base64
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.heartbeat import HeartbeatWriter, live_workers, process_heartbeat, read_heartbeat
from relax_bus.kv_counter import KvCounter
from relax_bus.kv_keys import kv_keys
from relax_bus.policy_version import PolicyVersion
from relax_bus.provision import CONFIG_KEY, delete_run
from schemas import UnknownSchemaVersion, WorkerHeartbeat, encode
from tests.waiting import until
from workers.config import PipelineConfig
from workers.roles.feeder import feed
from workers.state_keys import FEEDER_CURSOR, GROUPS_DROPPED, POLICY_VERSION, TRAINER_CHECKPOINT, TRAINER_STEP

ROOT = Path(__file__).resolve().parents[2]


async def raw(kv, key: str) -> bytes:
    """The stored bytes of `key`, as `nats kv get BUCKET KEY` prints them."""
    entry = await kv.get(key)
    assert entry.value is not None
    return entry.value


def relax(*args: str, stdin: bytes = b"", timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args], input=stdin, capture_output=True, timeout=timeout, cwd=ROOT
    )


@pytest.mark.bus
async def test_a_heartbeat_is_one_json_object_in_the_workers_bucket(bus):
    started = time.time()
    writer = HeartbeatWriter(
        bus.workers,
        "reward.w1",
        lambda: process_heartbeat(bus.run, "reward", "w1", started, policy_version=3, counters={"processed": 5}),
        interval_s=60,
    )
    await writer.beat()
    value = json.loads(await raw(bus.workers, "reward.w1"))
    assert value["kind"] == "heartbeat" and value["role"] == "reward" and value["worker_id"] == "w1"
    assert value["policy_version"] == 3 and value["counters"] == {"processed": 5}
    (beat,) = await live_workers(bus.workers)
    assert beat.worker_id == "w1" and beat.counters == {"processed": 5}


@pytest.mark.bus
async def test_an_old_msgpack_heartbeat_is_still_read_and_a_newer_major_is_not(bus):
    old = WorkerHeartbeat(run=bus.run, role="rollout", worker_id="old", pid=1, host="h", started_at=time.time())
    await bus.workers.put("rollout.old", encode(old))  # what workers wrote before heartbeats were JSON
    newer = {**old.model_dump(mode="json"), "worker_id": "next", "schema_version": "2.0"}
    await bus.workers.put("rollout.next", json.dumps(newer).encode())
    assert [b.worker_id for b in await live_workers(bus.workers)] == ["old"]
    with pytest.raises(UnknownSchemaVersion, match=r"version 2\.0 is not supported"):
        read_heartbeat(await raw(bus.workers, "rollout.next"))


@pytest.mark.bus
async def test_every_run_state_value_written_by_the_bus_and_the_feeder_is_json(make_bus):
    bus = await make_bus(groups_per_step=2, staleness={"max_staleness": 0}, trainer={"steps": 3})
    version = PolicyVersion(bus.state)
    await version.advance(1, 0)
    await KvCounter(bus.state, GROUPS_DROPPED).add(2)
    stop = asyncio.Event()
    task = asyncio.create_task(feed(bus, stop))
    try:
        await until(lambda: kv_keys(bus.state), lambda keys: FEEDER_CURSOR in keys, 60, "feeder cursor written")
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert json.loads(await raw(bus.state, POLICY_VERSION)) == 1
    assert json.loads(await raw(bus.state, GROUPS_DROPPED)) == 2
    assert json.loads(await raw(bus.state, FEEDER_CURSOR)) >= 2
    assert json.loads(await raw(bus.state, CONFIG_KEY))["run"] == bus.run
    for key in await kv_keys(bus.state):
        json.loads(await raw(bus.state, key))  # nothing else in the bucket is binary either


@pytest.mark.e2e
@pytest.mark.timeout(600)
async def test_after_a_real_run_every_state_value_is_json_and_relax_decode_reads_its_messages(
    nats_server, settings, tmp_path
):
    run = f"rs{time.time_ns() % 10**9}"
    config = tmp_path / "run.yaml"
    config.write_text(
        "run: placeholder\ngroups_per_step: 2\nsamples_per_group: 2\nstaleness: {max_staleness: 1}\n"
        "model: {source: 'tiny:64x2'}\ntask: {type: addition, options: {seed: 1}}\n"
        "rollout: {max_new_tokens: 3, batch_groups: 2}\n"
        "trainer: {steps: 8, optim: {lr: 1.0e-3}, warmup: {max_steps: 0}}\nbus: {ack_wait_s: 4, heartbeat_ttl_s: 3}\n"
    )
    # The overrides travel the whole way: run id by flag, step count and checkpoints by key=value.
    done = await asyncio.to_thread(
        relax,
        "run",
        str(config),
        "--nats-url",
        nats_server.url,
        "--run-dir",
        str(tmp_path / "run"),
        "--run-id",
        run,
        "trainer.steps=2",
        "trainer.checkpoint.every=1",
        "roles.reference=0",
        timeout=540,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    nc = await connect(settings, name="test")
    try:
        bus = await Bus.attach(nc, run, PipelineConfig)
        await check_finished_run(bus, run)
    finally:
        await delete_run(nc.jetstream(), bus.config)
        await nc.close()


async def check_finished_run(bus: Bus, run: str) -> None:
    state = {key: json.loads(await raw(bus.state, key)) for key in await kv_keys(bus.state)}
    assert state[TRAINER_STEP] == 2 and state[POLICY_VERSION] >= 1 and state[FEEDER_CURSOR] >= 4
    assert state[TRAINER_CHECKPOINT]["step"] == 2 and state[TRAINER_CHECKPOINT]["object"]
    assert state[CONFIG_KEY]["trainer"]["steps"] == 2 and state[CONFIG_KEY]["trainer"]["checkpoint"]["every"] == 1

    msg = await bus.js.get_msg(f"RELAX_{run}_TRAIN", 1)
    one = relax("decode", stdin=msg.data)  # as `nats stream get ... --translate 'relax decode'` runs it
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["kind"] == "train_group"
    stored = {
        "subject": msg.subject,
        "seq": msg.seq,
        "hdrs": base64.b64encode(b"NATS/1.0\r\nRelax-Kind: train_group\r\n\r\n").decode(),
        "data": base64.b64encode(msg.data).decode(),
    }
    as_cli_json = relax("decode", stdin=json.dumps(stored).encode())  # `nats stream get ... --json | relax decode`
    assert as_cli_json.returncode == 0, as_cli_json.stderr
    decoded = json.loads(as_cli_json.stdout)
    assert decoded["headers"] == {"Relax-Kind": "train_group"} and decoded["message"]["kind"] == "train_group"
    lines = relax("decode", "--lines", stdin=base64.b64encode(msg.data) + b"\n" + base64.b64encode(msg.data) + b"\n")
    assert lines.returncode == 0, lines.stderr
    assert [json.loads(line)["kind"] for line in lines.stdout.splitlines()] == ["train_group", "train_group"]

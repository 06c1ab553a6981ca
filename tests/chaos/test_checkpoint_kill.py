"""SIGKILL of the trainer in the middle of an asynchronous checkpoint.

Checkpoints are saved in the background while the next steps train, and the KV record names one only
once it is whole. Into the object store: killed mid-upload, the actor leaves chunks that no object names
and a record that still names the previous checkpoint: the restarted actor clears those chunks, resumes
from that previous checkpoint, and the run still trains every group exactly once. The kill is timed by the
bus itself: the test subscribes to the checkpoints store's chunk subjects and SIGKILLs the actor on the first
chunk of an upload, with a checkpoint of ~75 MB in flight.

Sharded (`trainer.checkpoint.dir`): the actor is killed as soon as a later step's directory has anything in
it; the restart removes that directory, which no record names, and resumes from the previous one.
"""

from __future__ import annotations

import json
from pathlib import Path

import nats.js.errors
import pytest
from nats.aio.msg import Msg
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE

from tests.e2e.cluster import Cluster, role_events, small_config
from tests.e2e.test_pipeline import run_id
from tests.waiting import until
from workers.config import parse_config
from workers.state_keys import TRAINER_CHECKPOINT

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

STEPS = 8


async def test_sigkill_mid_checkpoint_resumes_from_the_previous_complete_one(nats_server, tmp_path):
    config = parse_config(
        small_config(
            run_id(),
            model={"source": "tiny:512x2"},  # 6.3 M parameters: model and optimizer state make ~75 MB to upload
            trainer={"steps": STEPS, "checkpoint": {"every": 2}},
            weights={"type": "filesystem", "root": str(tmp_path / "weights")},
        )
    )
    cluster = await Cluster.start(nats_server.url, config, tmp_path)
    try:
        bus = cluster.bus
        assert bus is not None
        store = bus.checkpoints
        await until(lambda: _record(cluster), lambda r: r is not None, 240, "the step-0 checkpoint's record")
        cut: list[str] = []

        async def on_chunk(msg: Msg) -> None:
            if not cut:
                cluster.kill("actor")
                cut.append(msg.subject)

        chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=store.bucket, obj="*")
        sub = await bus.nc.subscribe(chunks, cb=on_chunk, pending_bytes_limit=1 << 30)
        await until(lambda: list(cut), bool, 240, "an upload into the checkpoints store after the first checkpoint")
        await sub.unsubscribe()
        record = await _record(cluster)
        assert record is not None
        nuid = cut[0].rsplit(".", 1)[1]
        # The kill landed mid-upload: chunks in the stream that no object names, the record on the one before.
        left = (await bus.js.get_last_msg(store.stream, cut[0])).data
        assert left, "the cut-off upload left no chunk behind"
        named = [await store.info(name) for name in await store.names()]
        assert nuid not in {i.nuid for i in named if i is not None}, f"the upload finished before the kill: {named}"
        assert await store.get(record["object"]), "the record names a checkpoint that cannot be read"

        cluster.restart("actor")
        await cluster.wait_done(timeout_s=360)
        acc = await cluster.accounting()
        acc.check_exactly_once(STEPS, config.groups_per_step)
        actor = cluster.role("actor")
        resumed = role_events(actor, "actor_resumed")
        assert [e["step"] for e in resumed] == [record["step"]], resumed
        assert [e["uploads"] for e in role_events(actor, "cut_off_uploads_cleared")] == [1]
        assert not (await bus.js.get_last_msg(store.stream, cut[0])).data, "the cut-off chunks are still stored"
        final = await _record(cluster)
        assert final is not None and final["step"] == STEPS
    finally:
        await cluster.stop()


async def test_sigkill_mid_sharded_checkpoint_resumes_from_the_previous_complete_one(nats_server, tmp_path):
    root = tmp_path / "checkpoints"
    config = parse_config(
        small_config(
            run_id(),
            model={"source": "tiny:512x2"},
            trainer={"steps": STEPS, "checkpoint": {"every": 2, "dir": str(root)}},
        )
    )
    cluster = await Cluster.start(nats_server.url, config, tmp_path)
    try:
        first = await until(lambda: _record(cluster), lambda r: r is not None, 240, "the step-0 checkpoint's record")
        assert first is not None and first["dir"] == str(root / config.run / "ckpt-0")

        def started() -> list[str]:  # a save of a later step has begun: its directory exists, with anything in it
            return [p.name for p in (root / config.run).iterdir() if p.name != "ckpt-0" and any(p.iterdir())]

        cut = await until(started, bool, 240, "a sharded checkpoint after step 0 begun", poll_s=0.01)
        cluster.kill("actor")
        record = await _record(cluster)
        assert record is not None and f"ckpt-{record['step']}" not in cut, (record, cut)
        assert (root / config.run / cut[0]).is_dir()

        cluster.restart("actor")
        await cluster.wait_done(timeout_s=360)
        acc = await cluster.accounting()
        acc.check_exactly_once(STEPS, config.groups_per_step)
        actor = cluster.role("actor")
        assert [e["step"] for e in role_events(actor, "actor_resumed")] == [record["step"]]
        assert [e["dirs"] for e in role_events(actor, "cut_off_checkpoints_cleared")] == [cut]
        final = await _record(cluster)
        assert final is not None and final["step"] == STEPS and final["dir"] == str(root / config.run / f"ckpt-{STEPS}")
        shards = sorted(p.name for p in Path(final["dir"]).iterdir())
        assert shards == ["shard-00001-model-00001-of-00001.safetensors", "state.json"], shards
    finally:
        await cluster.stop()


async def _record(cluster: Cluster) -> dict | None:
    assert cluster.bus is not None
    try:
        entry = await cluster.bus.state.get(TRAINER_CHECKPOINT)
    except nats.js.errors.KeyNotFoundError:  # no checkpoint yet
        return None
    return json.loads(entry.value or b"{}") or None

import pytest

from relax_bus.connection import connect
from relax_bus.errors import RunNotFound, TopologyConflict
from relax_bus.provision import delete_run, provision, read_config
from tests.conftest import run_config
from workers.config import PipelineConfig

pytestmark = pytest.mark.bus


async def test_applying_twice_is_idempotent(settings):
    config = run_config()
    nc = await connect(settings)
    js = nc.jetstream()
    try:
        first = await provision(js, config)
        assert len(first.created) == 9 + 4 + 3 + 3 and not first.updated  # streams, durables, buckets, stores
        second = await provision(js, config)
        assert second.created == [] and second.updated == []
        assert sorted(second.unchanged) == sorted(first.created)
        assert await read_config(js, config.run, model=PipelineConfig) == config
        names = {s.config.name for s in await js.streams_info()}
        assert sum(n.startswith(f"RELAX_{config.run}_") for n in names) == 9
    finally:
        await nc.close()


async def test_tunable_change_updates_in_place(settings):
    config = run_config()
    nc = await connect(settings)
    js = nc.jetstream()
    try:
        await provision(js, config)
        tuned = run_config(run=config.run, bus={"max_ack_pending": 7, "hop_max_msgs": 50})
        report = await provision(js, tuned)
        assert f"RELAX_{config.run}_PROMPTS/rollout" in report.updated
        assert f"RELAX_{config.run}_PROMPTS" in report.updated
        ci = await js.consumer_info(f"RELAX_{config.run}_PROMPTS", "rollout")
        assert ci.config.max_ack_pending == 7
        assert (await js.stream_info(f"RELAX_{config.run}_ROLLOUTS")).config.max_msgs == 50
        assert await read_config(js, config.run, model=PipelineConfig) == tuned
    finally:
        await nc.close()


async def test_incompatible_change_is_refused_and_nothing_changes(settings):
    config = run_config()
    nc = await connect(settings)
    js = nc.jetstream()
    try:
        await provision(js, config)
        changed = run_config(run=config.run, groups_per_step=5, bus={"storage": "memory"})
        with pytest.raises(TopologyConflict, match=r"bus.storage: 'file' -> 'memory'; groups_per_step: 2 -> 5"):
            await provision(js, changed)
        assert await read_config(js, config.run, model=PipelineConfig) == config
    finally:
        await nc.close()


async def test_unknown_run_is_reported(settings):
    nc = await connect(settings)
    try:
        with pytest.raises(RunNotFound, match="relax init"):
            await read_config(nc.jetstream(), "never-made", model=PipelineConfig)
    finally:
        await nc.close()


async def test_delete_run_removes_only_that_runs_objects(settings):
    # Two runs on one server: their reservations are kept small, so the test does not depend on the
    # host's free disk (JetStream caps file storage at a share of it; two default runs reserve 12 GiB).
    small = {"train_max_bytes": "256MiB", "media_max_bytes": "256MiB", "hop_max_bytes": "256MiB"}
    kept, gone = run_config(bus=small), run_config(bus=small)
    nc = await connect(settings)
    js = nc.jetstream()
    try:
        await provision(js, kept)
        await provision(js, gone)
        deleted = await delete_run(js, gone)
        streams = {s.config.name for s in await js.streams_info()}
        assert len(deleted) == 9 + 3 + 3, deleted
        assert not any(gone.run in name for name in streams), streams
        assert sum(name.startswith(f"RELAX_{kept.run}_") for name in streams) == 9
        assert f"KV_relax_{kept.run}_state" in streams and f"OBJ_relax_{kept.run}_weights" in streams
        assert await read_config(js, gone.run, missing_ok=True, model=PipelineConfig) is None
        assert await delete_run(js, gone) == []  # repeatable: what is gone is skipped
    finally:
        await nc.close()

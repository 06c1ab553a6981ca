"""Checkpoints off the critical path: the actor snapshots at the step, and serialises, uploads and records in the
background (real nats-server, real trainer on the tiny model)."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import Future

import pytest
import torch

from tests.e2e.cluster import small_config
from workers.checkpoints.whole import read_checkpoint
from workers.config import parse_config
from workers.data.models import materialize
from workers.roles.actor import Actor
from workers.state_keys import TRAINER_CHECKPOINT
from workers.training.trainer import PolicyTrainer
from workers.weights import ObjectStoreTransport

pytestmark = [pytest.mark.workers, pytest.mark.bus]


def moved(trainer: PolicyTrainer) -> None:
    """What a training step does to the weights, in place."""
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.01)


def weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.full_state().items()}


def hold_puts(bus):
    """Hold every object-store put until the returned event is set: an upload in flight, for as long as a test
    wants. Returns the real put, the release event, and an event set once a put is waiting."""
    real_put = bus.checkpoints.put
    release, entered = asyncio.Event(), asyncio.Event()

    async def held_put(name, data):
        entered.set()
        await release.wait()
        return await real_put(name, data)

    bus.checkpoints.put = held_put
    return real_put, release, entered


async def record_of(bus) -> dict:
    return json.loads((await bus.state.get(TRAINER_CHECKPOINT)).value)


async def test_the_record_names_a_checkpoint_only_once_it_is_whole(make_bus, tmp_path, one_torch_thread):
    config = parse_config(small_config("ckpt", model={"source": "tiny:64x2"}))
    bus = await make_bus(config)
    model_dir = materialize("tiny:64x2", tmp_path / "m", seed=0)
    actor = Actor(bus, PolicyTrainer(model_dir, config), ObjectStoreTransport(bus))
    await actor.setup([])  # publishes v0 and checkpoints step 0
    await actor.checkpoints.wait()
    assert (await record_of(bus))["step"] == 0

    # Step 2's checkpoint: the upload is held back while the next step trains.
    moved(actor.trainer)
    actor.state.step = 2
    at_step_2 = weights(actor.trainer)
    real_put, release, _ = hold_puts(bus)
    await actor._checkpoint()  # returns with the save in flight
    assert actor.checkpoints.saving is not None and not actor.checkpoints.saving.done()
    moved(actor.trainer)  # the next step changes the weights in place while the save waits
    assert (await record_of(bus))["step"] == 0  # the object is not whole: the record still names step 0
    release.set()
    await actor.checkpoints.wait()
    record = await record_of(bus)
    assert record["step"] == 2
    saved = read_checkpoint(await bus.checkpoints.get(record["object"]))["model"]
    assert all(torch.equal(saved[k], at_step_2[k]) for k in at_step_2)  # the snapshot, not the moved weights

    # Step 4's upload breaks off (a crash mid-upload): the record keeps step 2, which a restart restores.
    actor.state.step = 4

    async def broken_put(name, data):
        raise ConnectionError("upload cut off")

    bus.checkpoints.put = broken_put
    await actor._checkpoint()
    with pytest.raises(ConnectionError, match="cut off"):
        await actor.checkpoints.wait()
    assert (await record_of(bus))["step"] == 2
    bus.checkpoints.put = real_put
    restarted = Actor(bus, PolicyTrainer(model_dir, config), ObjectStoreTransport(bus))
    await restarted.setup([])
    assert restarted.state.step == 2
    restored = weights(restarted.trainer)
    assert all(torch.equal(restored[k], at_step_2[k]) for k in at_step_2)


async def test_the_run_waits_for_the_checkpoint_in_flight(make_bus, tmp_path, one_torch_thread):
    config = parse_config(small_config("ckptend", model={"source": "tiny:64x2"}, trainer={"steps": 1}))
    bus = await make_bus(config)
    actor = Actor(bus, PolicyTrainer(materialize("tiny:64x2", tmp_path / "m", 0), config), ObjectStoreTransport(bus))
    await actor.setup([])
    await actor.checkpoints.wait()
    actor.state.step = 1  # the run's steps are done: run() only finishes what is in flight
    _, release, entered = hold_puts(bus)
    await actor._checkpoint()
    running = asyncio.create_task(actor.run(asyncio.Event()))
    await asyncio.wait_for(entered.wait(), 30)  # the upload is in flight and held
    assert not running.done()  # so the run cannot have finished: the last checkpoint is not whole yet
    release.set()
    assert await asyncio.wait_for(running, 30) == 1
    assert (await record_of(bus))["step"] == 1


async def test_a_sharded_checkpoint_is_recorded_once_every_shard_is_written(make_bus, tmp_path, one_torch_thread):
    root = tmp_path / "checkpoints"
    config = parse_config(
        small_config("ckptdir", model={"source": "tiny:64x2"}, trainer={"checkpoint": {"dir": str(root)}})
    )
    bus = await make_bus(config)
    model_dir = materialize("tiny:64x2", tmp_path / "m", seed=0)
    actor = Actor(bus, PolicyTrainer(model_dir, config), ObjectStoreTransport(bus))
    await actor.setup([])
    await actor.checkpoints.wait()
    assert (await record_of(bus))["dir"] == str(root / bus.run / "ckpt-0")

    # Step 2's shards: the write is held back (its future unresolved) while the next step trains.
    real_save, release = actor.trainer.checkpoints.save_sharded, threading.Event()

    def held_save(path, extra):
        written = real_save(path, extra)
        held: Future = Future()
        threading.Thread(target=lambda: (release.wait(60), held.set_result(written.result()))).start()
        return held

    actor.trainer.checkpoints.save_sharded = held_save
    moved(actor.trainer)
    actor.state.step = 2
    at_step_2 = weights(actor.trainer)
    await actor._checkpoint()
    moved(actor.trainer)
    assert (await record_of(bus))["step"] == 0  # not every shard is known written: the record names step 0
    release.set()
    await actor.checkpoints.wait()
    assert (await record_of(bus))["dir"] == str(root / bus.run / "ckpt-2")

    restarted = Actor(bus, PolicyTrainer(model_dir, config), ObjectStoreTransport(bus))
    (root / bus.run / "ckpt-4").mkdir()  # a save cut off by a crash: no record names it
    await restarted.setup([])
    assert restarted.state.step == 2 and not (root / bus.run / "ckpt-4").exists()
    restored = weights(restarted.trainer)
    assert all(torch.equal(restored[k], at_step_2[k]) for k in at_step_2)
    assert not [n for n in await bus.checkpoints.names() if n.startswith("ckpt-")]  # none in the store

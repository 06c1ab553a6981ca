"""Sharded checkpoints (`workers.checkpoints.sharded`): every rank writes its own shards in the background,
any world size reads them back bit for bit, and nothing in them is pickled (real trainers on the tiny model; two
ranks are two spawned processes under gloo with FSDP2)."""

from __future__ import annotations

import json
import os
import pickle
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workers.checkpoints.sharded import STATE_FILE
from workers.config import parse_config
from workers.data.models import materialize
from workers.errors import CheckpointRefused
from workers.training.trainer import PolicyTrainer

pytestmark = [pytest.mark.workers, pytest.mark.timeout(300)]

CONFIG = {"run": "shards", "trainer": {"schedule": {"kind": "cosine"}, "steps": 4}}
EXTRA = {"step": 3, "trained": [[0, 7]], "floor": 11}


class _Planted:
    """Unpickling it creates a directory: a stand-in for any code a forged pickle could run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def trainer_at(model_dir: Path, updates: int) -> PolicyTrainer:
    """A trainer after `updates` optimizer updates with the same gradient on every rank (all ones)."""
    trainer = PolicyTrainer(model_dir, parse_config(CONFIG))
    for _ in range(updates):
        for p in trainer.model.parameters():
            p.grad = torch.ones_like(p)
        trainer.optimizer.step()
        trainer.scheduler.step()
    return trainer


def moved(trainer: PolicyTrainer) -> None:
    """What the next step does to the weights and the optimizer state, in place."""
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.5)
        for state in trainer.optimizer.state.values():
            state["exp_avg"].add_(0.5)


def local(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def full(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, whole (a collective under FSDP2)."""
    out = {f"param/{n}": local(p).detach().clone() for n, p in trainer.model.named_parameters()}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for p, state in trainer.optimizer.state.items():
        for key, value in state.items():
            out[f"optim/{names[id(p)]}/{key}"] = local(value).detach().clone()
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_one_rank_round_trips_exactly_what_it_held_when_the_save_started(tmp_path):
    model_dir = materialize("tiny:64x2", tmp_path / "m", seed=2)
    trainer = trainer_at(model_dir, 2)
    at_save = full(trainer)
    written = trainer.checkpoints.save_sharded(str(tmp_path / "ckpt-3"), EXTRA)
    moved(trainer)  # the next step, while the shards are written
    written.result(timeout=120)
    files = sorted(p.name for p in (tmp_path / "ckpt-3").iterdir())
    assert files == ["shard-00001-model-00001-of-00001.safetensors", STATE_FILE], files  # no pickle anywhere

    fresh = trainer_at(model_dir, 0)
    assert fresh.checkpoints.restore_sharded(str(tmp_path / "ckpt-3")) == EXTRA
    assert_same(full(fresh), at_save)
    assert fresh.scheduler.state_dict()["last_epoch"] == 2
    assert fresh.scheduler.get_last_lr() == trainer.scheduler.get_last_lr()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_ranks(rank: int, port: int, model_dir: str, out: str) -> None:
    """Rank `rank` of 2: save a sharded checkpoint after 2 updates, then load the one-rank checkpoint in
    `out/from-1` and write what it holds (rank 0) for the parent to compare."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        trainer = trainer_at(Path(model_dir), 2)
        assert trainer.world == 2
        at_save = full(trainer)
        trainer.checkpoints.save_sharded(f"{out}/from-2", EXTRA)
        moved(trainer)
        trainer.checkpoints.wait()
        fresh = trainer_at(Path(model_dir), 0)
        extra = fresh.checkpoints.restore_sharded(f"{out}/from-1")
        loaded = full(fresh)
        if rank == 0:
            torch.save({"at_save": at_save, "loaded": loaded, "extra": extra}, f"{out}/rank0.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_shards_of_two_ranks_load_on_one_and_one_ranks_load_on_two(tmp_path):
    model_dir = materialize("tiny:64x2", tmp_path / "m", seed=2)
    one = trainer_at(model_dir, 2)
    one.checkpoints.save_sharded(str(tmp_path / "from-1"), EXTRA).result(timeout=120)
    mp.spawn(_two_ranks, args=(_free_port(), str(model_dir), str(tmp_path)), nprocs=2, join=True)

    shards = sorted(p.name for p in (tmp_path / "from-2").iterdir() if p.suffix == ".safetensors")
    assert shards == [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)], shards
    fresh = trainer_at(model_dir, 0)
    assert fresh.checkpoints.restore_sharded(str(tmp_path / "from-2")) == EXTRA
    two = torch.load(tmp_path / "rank0.pt")  # written by the test's own child: a plain load
    assert_same(full(fresh), two["at_save"])  # 2 ranks -> 1: what the two ranks held at the save
    assert_same(two["at_save"], full(one))  # the same updates on 1 and 2 ranks give the same numbers
    assert_same(two["loaded"], full(one))  # 1 rank -> 2
    assert two["extra"] == EXTRA


def test_a_sharded_checkpoint_is_read_without_pickle_and_a_broken_one_is_refused(tmp_path):
    model_dir = materialize("tiny:64x2", tmp_path / "m", seed=2)
    path = tmp_path / "ckpt-1"
    trainer_at(model_dir, 1).checkpoints.save_sharded(str(path), EXTRA).result(timeout=120)
    marker = tmp_path / "planted"
    (path / ".metadata").write_bytes(pickle.dumps({"x": _Planted(str(marker))}))  # DCP's usual metadata file
    fresh = trainer_at(model_dir, 0)
    assert fresh.checkpoints.restore_sharded(str(path)) == EXTRA
    assert not marker.exists(), "a pickle in the checkpoint was loaded"

    (path / STATE_FILE).write_text(json.dumps(["not", "a", "checkpoint"]))
    with pytest.raises(CheckpointRefused, match="is not a trainer checkpoint"):
        fresh.checkpoints.restore_sharded(str(path))
    (path / STATE_FILE).unlink()
    with pytest.raises(CheckpointRefused, match=f"{STATE_FILE}"):
        fresh.checkpoints.restore_sharded(str(path))

    other = tmp_path / "ckpt-2"
    trainer_at(model_dir, 1).checkpoints.save_sharded(str(other), EXTRA).result(timeout=120)
    next(other.glob("*.safetensors")).unlink()  # a shard lost
    with pytest.raises(CheckpointRefused, match="refused, not loaded"):
        fresh.checkpoints.restore_sharded(str(other))

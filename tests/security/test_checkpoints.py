"""Checkpoints come from the bus, so anyone who can write the run's object store could plant one: loading
them must never run code. They are read with `torch.load(weights_only=True)` (tensors, containers and
numbers only)."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from workers.config import parse_config
from workers.data.models import materialize
from workers.errors import CheckpointRefused
from workers.training.trainer import PolicyTrainer

pytestmark = pytest.mark.workers


class _Planted:
    """What a forged checkpoint holds: unpickling it would create a file (any code could run there)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _trainer(tmp_path) -> PolicyTrainer:
    model_dir = materialize("tiny:64x2", tmp_path / "m", seed=2)
    config = parse_config({"run": "ck", "trainer": {"schedule": {"kind": "cosine"}, "steps": 4}})
    return PolicyTrainer(model_dir, config)


def test_a_checkpoint_with_code_in_it_is_refused_and_runs_nothing(tmp_path):
    trainer = _trainer(tmp_path)
    marker = tmp_path / "planted"
    forged = pickle.dumps({"model": {}, "optimizer": {}, "extra": {"x": _Planted(str(marker))}})
    with pytest.raises(CheckpointRefused, match="Weights only load failed"):
        trainer.checkpoints.restore(forged)
    assert not marker.exists(), "unpickling ran the planted call"
    buf = io.BytesIO()
    torch.save({"model": {"w": torch.zeros(1)}, "extra": _Planted(str(marker))}, buf)
    with pytest.raises(CheckpointRefused):
        trainer.checkpoints.restore(buf.getvalue())
    assert not marker.exists()
    with pytest.raises(CheckpointRefused, match="not a trainer checkpoint"):
        buf = io.BytesIO()
        torch.save([torch.zeros(1)], buf)
        trainer.checkpoints.restore(buf.getvalue())


def test_a_real_checkpoint_round_trips_without_pickle(tmp_path):
    trainer = _trainer(tmp_path)
    for p in trainer.model.parameters():
        p.grad = torch.ones_like(p)
    trainer.optimizer.step()  # optimizer state worth keeping: exp_avg, exp_avg_sq, step
    trainer.scheduler.step()
    data = trainer.checkpoints.to_bytes({"step": 3, "trained": ["e0-i1", "e0-i2"], "floor": 7})
    fresh = _trainer(tmp_path)
    extra = fresh.checkpoints.restore(data)
    assert extra == {"step": 3, "trained": ["e0-i1", "e0-i2"], "floor": 7}
    for (name, a), b in zip(trainer.model.named_parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert fresh.scheduler.get_last_lr() == trainer.scheduler.get_last_lr()
    saved, loaded = trainer.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys() and saved
    for key in saved:
        assert torch.equal(saved[key]["exp_avg"], loaded[key]["exp_avg"])


@pytest.fixture
async def secured(tmp_path):
    from tests.bus.test_auth import secured_server
    from tests.conftest import run_config

    async with secured_server(run_config(trainer={"kl": {"coef": 0.1}}), tmp_path) as s:
        yield s


@pytest.mark.bus
async def test_no_role_but_the_trainer_reads_a_checkpoint(secured):
    """Finding 7: checkpoints (optimizer state, the run's ledger) sat in the weights store, which the rollout and
    the reference read. They have a store of their own now, which only the actor (and the admin) may read."""
    import nats.errors

    from tests.bus.test_auth import provisioned, violation

    s = secured
    admin = await provisioned(s)
    actor = await s.bus("actor")
    await actor.checkpoints.put("ckpt-000002", b"optimizer state and ledger")
    assert await actor.checkpoints.get("ckpt-000002") == b"optimizer state and ledger"
    stream = actor.checkpoints.stream
    for role in ("rollout", "reference", "reward", "feeder", "observer"):
        nc = await s.connect(role)
        js = nc.jetstream(timeout=1.0)
        with pytest.raises(nats.errors.TimeoutError):
            await js.get_last_msg(stream, "$O.>")
        assert violation("publish", f"$JS.API.STREAM.MSG.GET.{stream}") in s.violations(role), role
    assert await admin.checkpoints.names() == ["ckpt-000002"]

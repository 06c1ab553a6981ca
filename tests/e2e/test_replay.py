"""`relax replay`: a step recomputed from the checkpoint before it reproduces the logged loss."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.e2e.cluster import small_config
from tests.e2e.test_pipeline import run, run_id
from workers.config import parse_config
from workers.data.models import load_model
from workers.errors import ReplayFailed
from workers.launch.export import export
from workers.launch.replay import replay
from workers.training.trainer import PolicyTrainer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

LENGTH = {"type": "python", "options": {"function": "tests.workers.reward_fns:length_credit"}}


@pytest.mark.parametrize("sharded", [False, True], ids=["object-store-checkpoints", "sharded-checkpoints"])
async def test_replay_reproduces_the_logged_loss(nats_server, tmp_path, sharded):
    trainer = {"steps": 6, "checkpoint": {"every": 2, "keep": 2}, "kl": {"coef": 0.05}}
    if sharded:
        trainer["checkpoint"]["dir"] = str(tmp_path / "checkpoints")
    config = parse_config(
        small_config(run_id(), rollout={"max_new_tokens": 6, "batch_groups": 4}, rewards=[LENGTH], trainer=trainer)
    )
    cluster = await run(nats_server, tmp_path, config)
    try:
        bus = cluster.bus
        assert bus is not None
        names = sorted(n for n in await bus.checkpoints.names() if n.startswith("ckpt-"))
        if sharded:  # every checkpoint is a directory of shards; the store holds none
            assert names == []
            names = sorted(p.name for p in (tmp_path / "checkpoints" / config.run).iterdir())
        assert names == ["ckpt-0", "ckpt-4", "ckpt-6"], names  # step 0 and the newest two
        exact = await replay(bus, 5, tmp_path / "replay")  # straight from ckpt-4
        assert exact.checkpoint_step == 4 and exact.replayed_steps == []
        # Not a degenerate step: it had a gradient and a KL term. (The loss itself can be near 0 for any
        # step: GRPO advantages have zero mean per group, so its size says nothing; 2e-5 was seen.)
        assert exact.logged["grad_norm"] > 1e-3 and exact.logged["kl"] > 0, exact.logged
        assert exact.matches(), exact.as_dict()
        assert exact.recomputed["reward_mean"] == exact.logged["reward_mean"]
        for key in ("grad_norm", "kl"):  # quantities far from 0, reproduced as closely as the loss
            assert exact.recomputed[key] == pytest.approx(exact.logged[key], rel=1e-4), (key, exact.as_dict())
        # From the step-0 checkpoint, re-applying steps 1-3 on their recorded groups first.
        far = await replay(bus, 4, tmp_path / "replay")
        assert far.checkpoint_step == 0 and far.replayed_steps == [1, 2, 3]
        assert far.matches(), far.as_dict()
        with pytest.raises(ReplayFailed, match="no complete record of step 9"):
            await replay(bus, 9, tmp_path / "replay")

        cli = [sys.executable, "-m", "workers.cli", "replay", config.run, "--nats-url", nats_server.url]
        work = ["--work-dir", str(tmp_path / "replay")]
        done = subprocess.run([*cli, "--step", "6", *work], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "loss reproduced" in done.stdout and "from checkpoint of step 4" in done.stdout, done.stdout
        bad = subprocess.run([*cli, "--step", "0", *work], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and bad.stderr.startswith("relax: error: ") and "step 0" in bad.stderr, bad.stderr

        if sharded:  # `relax export` reads the newest directory of shards into one model
            result = await export(bus, tmp_path / "exported", None, tmp_path / "export-work")
            assert result["step"] == 6, result
            exported = load_model(tmp_path / "exported").state_dict()
            trained = PolicyTrainer(tmp_path / "export-work" / config.run / "base", config)
            trained.checkpoints.restore_sharded(str(tmp_path / "checkpoints" / config.run / "ckpt-6"))
            base = load_model(tmp_path / "export-work" / config.run / "base").state_dict()
            for name, value in trained.model.state_dict().items():
                assert torch.equal(exported[name], value), name
            assert any(not torch.equal(base[n], exported[n]) for n in base), "the export holds the base weights"
    finally:
        await cluster.stop()

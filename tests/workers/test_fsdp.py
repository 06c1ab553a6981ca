"""FSDP2 across two torchrun ranks computes the same update as one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax_bus.settings import RunConfig, parse_run_config
from schemas import PromptGroup, RolloutGroup, Sample, ScoredGroup, TextPart, TrainGroup, WireTensor
from workers.models import materialize
from workers.trainer import PolicyTrainer

pytestmark = [pytest.mark.workers, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]


def config() -> RunConfig:
    return parse_run_config(
        {"run": "fsdp", "groups_per_step": 2, "samples_per_group": 4, "trainer": {"lr": 1e-2, "grad_clip": 1e9}}
    )


def batch_groups() -> list[TrainGroup]:
    """Two groups of four equally long responses (equal token counts per rank keep the means equal)."""
    groups = []
    for g, rewards in enumerate(((1.0, 0.0, 0.0, 1.0), (0.0, 1.0, 0.0, 0.0))):
        prompt = PromptGroup(
            run="fsdp",
            group_id=f"g{g}",
            parts=(TextPart(text=f"{g}+1="),),
            n_samples=4,
            release_index=g,
            released_at_version=0,
        )
        samples = tuple(
            Sample(
                token_ids=WireTensor.from_values([48 + g + k, 49, 258], "int32"),
                logprobs=WireTensor.from_values([-5.0, -5.2, -5.5], "float32"),
            )
            for k in range(4)
        )
        rollout = RolloutGroup(
            prompt=prompt,
            prompt_token_ids=WireTensor.from_values([257, 48 + g, 43, 49, 61], "int32"),
            samples=samples,
            policy_version=0,
        )
        groups.append(TrainGroup(scored=ScoredGroup(rollout=rollout, rewards=rewards)))
    return groups


def test_two_rank_fsdp2_step_matches_one_process(tmp_path):
    model_dir = materialize("tiny:64x2", tmp_path / "base", seed=0)
    out = tmp_path / "fsdp.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "tests" / "workers" / "fsdp_step.py"),
        str(model_dir),
        str(out),
    ]
    result = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sharded = torch.load(out, weights_only=False)

    single = PolicyTrainer(model_dir, config())
    before = {k: v.clone() for k, v in single.model.state_dict().items()}
    metrics = single.step(batch_groups())
    after = single.model.state_dict()
    assert abs(metrics["reward_mean"] - sharded["metrics"]["reward_mean"]) < 1e-9
    assert abs(metrics["grad_norm"] - sharded["metrics"]["grad_norm"]) < 1e-4  # the same global gradient
    changed = 0
    for name, tensor in after.items():
        # Adam's first step moves each weight by about lr = 1e-2; float reduction order differs by ~1e-5.
        assert torch.allclose(sharded["state"][name], tensor, atol=1e-4), name
        changed += not torch.equal(before[name], tensor)
    assert changed > 0, "the step changed no weights"

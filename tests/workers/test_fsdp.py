"""FSDP2 across two torchrun ranks computes the same update as one process, with and without supervised rows mixed in
(`trainer.sft`), and with a LoRA adapter on the frozen base (`trainer.lora`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from schemas import PromptGroup, RolloutGroup, Sample, ScoredGroup, TextPart, TrainGroup, WireTensor
from workers.config import PipelineConfig, parse_config
from workers.data.models import materialize
from workers.training.trainer import PolicyTrainer

pytestmark = [pytest.mark.workers, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]


LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


def config(sft: str | None = None, lora: bool = False) -> PipelineConfig:
    """The run; with `sft`, a JSONL dataset whose 3 rows per update the ranks share 2 and 1 (`sft_dataset`)."""
    return parse_config(
        {
            "run": "fsdp",
            "groups_per_step": 2,
            "samples_per_group": 4,
            # 16 padded tokens per micro-batch: rank 0 runs 2 micro-batches, rank 1 runs 3 (rank 0 adds an empty one)
            # The plain pass in one process too (FSDP2 always takes it): Adam's first step follows each gradient's
            # sign, so a near-zero gradient rounded differently by the shared-prompt pass could flip a weight.
            "trainer": {
                "optim": {"lr": 1e-2, "grad_clip": 1e9},
                "compute": {"micro_batch_tokens": 16, "shared_prompt": False},
                "sft": None if sft is None else {"dataset": sft, "coef": 0.5, "batch_size": 3},
                "lora": LORA if lora else None,
            },
        }
    )


def sft_dataset(path: Path) -> Path:
    """Four additions of unequal lengths: the ranks' shares hold unequal token counts, which must weigh as in one
    process."""
    answers = [("1+1=", "2"), ("12+30=", "42"), ("7+5=", "12"), ("100+250=", "350")]
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in answers))
    return path


def batch_groups() -> list[TrainGroup]:
    """Two groups of four responses; rank 0 takes group 0 (4 x 3 tokens), rank 1 group 1 (1, 2, 5 and 6 tokens):
    unequal token counts, which must weigh exactly as in one process."""
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
        lengths = (3, 3, 3, 3) if g == 0 else (1, 2, 5, 6)
        samples = tuple(
            Sample(
                token_ids=WireTensor.from_values([*(48 + (g + k + j) % 10 for j in range(n - 1)), 258], "int32"),
                logprobs=WireTensor.from_values([-5.0 - 0.1 * j for j in range(n)], "float32"),
            )
            for k, n in enumerate(lengths)
        )
        rollout = RolloutGroup(
            prompt=prompt,
            prompt_token_ids=WireTensor.from_values([257, 48 + g, 43, 49, 61], "int32"),
            samples=samples,
            policy_version=0,
        )
        groups.append(TrainGroup(scored=ScoredGroup(rollout=rollout, rewards=rewards)))
    return groups


@pytest.mark.parametrize(
    ("mixed", "lora"), [(False, False), (True, False), (False, True)], ids=["rl", "rl+sft", "lora"]
)
def test_two_rank_fsdp2_step_matches_one_process(tmp_path, mixed, lora):
    model_dir = materialize("tiny:64x2", tmp_path / "base", seed=0)
    out = tmp_path / "fsdp.pt"
    sft = str(sft_dataset(tmp_path / "sft.jsonl")) if mixed else None
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "tests" / "workers" / "fsdp_step.py"),
        str(model_dir),
        str(out),
        sft or "",
        "lora" if lora else "",
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
    sharded = torch.load(out, weights_only=True)

    single = PolicyTrainer(model_dir, config(sft, lora))
    if lora:  # B starts at zero, which leaves A's gradient zero in the first step: start it elsewhere on every rank
        torch.manual_seed(1)
        for name, param in single.model.named_parameters():
            if ".lora_B." in name:
                param.data.normal_(0, 0.1)
    before = {k: v.clone() for k, v in single.full_state().items()}
    metrics = single.step(batch_groups())
    after = single.full_state()
    assert abs(metrics["reward_mean"] - sharded["metrics"]["reward_mean"]) < 1e-9
    assert abs(metrics["grad_norm"] - sharded["metrics"]["grad_norm"]) < 1e-4  # the same global gradient
    if mixed:
        assert abs(metrics["sft_loss"] - sharded["metrics"]["sft_loss"]) < 1e-5  # the same rows, the same mean
    changed = 0
    for name, tensor in after.items():
        # Adam's first step moves each weight by about lr = 1e-2; float reduction order differs by ~1e-5.
        assert torch.allclose(sharded["state"][name], tensor, atol=1e-4), name
        changed += not torch.equal(before[name], tensor)
    assert changed > 0, "the step changed no weights"
    if lora:
        assert all(".lora_" in n for n, t in after.items() if not torch.equal(before[n], t)), "only the adapter moved"
        assert changed == 2 * 2 * 2, "A and B of both target modules in both layers moved"

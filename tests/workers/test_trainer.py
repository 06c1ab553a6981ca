"""The trainer's batch packing and step on real engine output (tiny model, CPU)."""

from __future__ import annotations

import pytest
import torch

from schemas import PromptGroup, RolloutGroup, ScoredGroup, TextPart, TrainGroup, WireTensor
from workers.config import parse_config
from workers.data.models import materialize
from workers.data.tasks import load_task
from workers.engines.base import SamplingSettings
from workers.engines.torch_engine import TorchEngine
from workers.roles.rollout import sample_of
from workers.training import warmup as warmup_module
from workers.training.batch import make_batch
from workers.training.logprobs import token_logprobs
from workers.training.trainer import PolicyTrainer

pytestmark = pytest.mark.workers


def engine_groups(
    engine: TorchEngine, prompts: list[str], n: int, temperature: float = 0.8, max_new_tokens: int = 5, seed: int = 3
) -> list[TrainGroup]:
    """One train group per prompt from the engine's samples (as the rollout role wraps them), rewards 0, 1, 0, ..."""
    tok = engine.tokenizer
    ids = [[tok.bos_token_id, *tok.encode(p, add_special_tokens=False)] for p in prompts]
    out = engine.generate(ids, n, SamplingSettings(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed))
    groups = []
    for i, (p, pid, samples) in enumerate(zip(prompts, ids, out, strict=True)):
        prompt = PromptGroup(
            run="t", group_id=f"g{i}", parts=(TextPart(text=p),), n_samples=n, release_index=i, released_at_version=0
        )
        rollout = RolloutGroup(
            prompt=prompt,
            prompt_token_ids=WireTensor.from_values(pid, "int32"),
            samples=tuple(sample_of(g) for g in samples),
            policy_version=0,
        )
        rewards = tuple(float(k % 2) for k in range(n))
        groups.append(TrainGroup(scored=ScoredGroup(rollout=rollout, rewards=rewards)))
    return groups


def test_packed_batch_lines_up_with_the_engines_logprobs(tmp_path):
    model_dir = materialize("tiny:64x2", tmp_path / "m", seed=1)
    engine = TorchEngine(model_dir)
    groups = engine_groups(engine, ["1+2=", "9+9=", "4+0="], n=3)
    batch = make_batch(groups)
    assert batch.ids.shape[0] == 9 and batch.rewards.shape == (3, 3)
    with torch.no_grad():
        logp = token_logprobs(engine.model, batch.ids, batch.attention, temperature=0.8)
    picked = logp[batch.mask.bool()]
    expected = batch.rollout_logp[batch.mask.bool()]
    assert picked.numel() == sum(s.token_ids.numel for g in groups for s in g.scored.rollout.samples)
    assert torch.allclose(picked, expected, atol=1e-4), (picked - expected).abs().max()


def test_a_step_moves_the_policy_toward_rewarded_samples(tmp_path):
    model_dir = materialize("tiny:64x2", tmp_path / "m", seed=2)
    config = parse_config(
        {
            "run": "t",
            "groups_per_step": 2,
            "samples_per_group": 4,
            "rollout": {"temperature": 0.8},
            "trainer": {"optim": {"lr": 5e-3, "grad_clip": 100.0}},
        }
    )
    trainer = PolicyTrainer(model_dir, config)
    engine = TorchEngine(model_dir)
    groups = engine_groups(engine, ["1+2=", "3+4="], n=4)
    batch = make_batch(groups)
    adv = torch.tensor([[-1.0, 1.0, -1.0, 1.0]] * 2).reshape(-1)  # odd samples were rewarded

    def seq_logp() -> torch.Tensor:
        with torch.no_grad():
            lp = token_logprobs(trainer.model, batch.ids, batch.attention, 0.8)
        return (lp * batch.mask).sum(-1)

    before = seq_logp()
    metrics = trainer.step(groups)
    after = seq_logp()
    assert metrics["tis_mean"] == pytest.approx(1.0, abs=1e-3)  # same weights generated them
    assert metrics["logprob_mismatch"] < 1e-4
    gained = (after - before)[adv > 0].mean() - (after - before)[adv < 0].mean()
    assert gained > 0, (before, after)


def test_warmup_keeps_its_best_checked_weights_when_accuracy_collapses(tmp_path, monkeypatch):
    model_dir = materialize("tiny:64x2", tmp_path / "m", seed=2)
    warmup = {"max_steps": 6, "target_accuracy": 0.95, "check_every": 2, "batch_size": 8}
    config = parse_config({"run": "t", "trainer": {"warmup": warmup}})
    trainer = PolicyTrainer(model_dir, config)
    checks = iter([0.3, 0.8, 0.1])  # what sampled accuracy reports at steps 2, 4 and 6
    snapshots = []

    def accuracy(items):
        snapshots.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
        return next(checks)

    monkeypatch.setattr(warmup_module, "sampled_accuracy", lambda trainer_, items: accuracy(items))
    info = warmup_module.run_warmup(trainer, load_task({"type": "addition", "seed": 0}))
    assert info == {"warmup_steps": 6.0, "warmup_accuracy": 0.8}
    at_step_4, at_step_6 = snapshots[1], snapshots[2]
    state = trainer.model.state_dict()
    assert all(torch.equal(state[k], at_step_4[k]) for k in state)
    assert not all(torch.equal(state[k], at_step_6[k]) for k in state)


def test_warmup_restores_the_optimizer_of_its_best_check_with_its_weights(tmp_path, monkeypatch):
    """The noisy-label steps after a restore continue from the optimizer of the restored check (Adam's moments of
    those weights, step counter 4), not from a fresh one (counter 0) nor the collapsed one (counter 6): a fresh
    AdamW takes full-size first steps and left the demo's start policy much weaker (reward 0.09 -> 0.46 in 120
    steps instead of 0.16 -> 0.83)."""
    model_dir = materialize("tiny:64x2", tmp_path / "m", seed=2)
    warmup = {"max_steps": 6, "target_accuracy": 0.95, "check_every": 2, "batch_size": 8}
    config = parse_config({"run": "t", "trainer": {"warmup": {**warmup, "label_noise": 0.5, "noise_steps": 1}}})
    trainer = PolicyTrainer(model_dir, config)
    checks = iter([0.3, 0.8, 0.1, 0.2])  # steps 2, 4, 6, then after the noisy step
    monkeypatch.setattr(warmup_module, "sampled_accuracy", lambda trainer_, items: next(checks))
    counters = []
    real_step = warmup_module._sft_step

    def step(trainer_, opt, chosen):
        state = opt.state_dict()["state"]
        counters.append(int(state[0]["step"]) if state else 0)
        return real_step(trainer_, opt, chosen)

    monkeypatch.setattr(warmup_module, "_sft_step", step)
    warmup_module.run_warmup(trainer, load_task({"type": "addition", "seed": 0}))
    assert counters == [0, 1, 2, 3, 4, 5, 4]

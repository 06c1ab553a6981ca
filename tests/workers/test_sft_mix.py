"""Supervised rows mixed into RL (`trainer.sft`) in the trainer's step, on the tiny model: the supervised loss falls
while RL trains, the gradient holds `coef` x the supervised one, micro-batches change nothing, and a restored trainer
goes on with the rows after its checkpoint's."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.factories import train
from tests.workers.test_trainer import engine_groups
from workers.config import parse_config
from workers.data.models import materialize
from workers.engines.torch_engine import TorchEngine
from workers.training.batch import make_batch
from workers.training.logprobs import token_logprobs
from workers.training.sft_mix import SftMix, rows_of_update
from workers.training.supervised import supervised_logprobs
from workers.training.trainer import PolicyTrainer

pytestmark = [pytest.mark.workers, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize("tiny:64x2", tmp_path_factory.mktemp("models") / "tiny", seed=2)


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """Twelve additions, two of them as conversations."""
    path = tmp_path / "sft.jsonl"
    lines: list[dict[str, Any]] = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(2, 4) for b in range(5)]
    lines += [
        {"messages": [{"role": "user", "content": f"{a}+5="}, {"role": "assistant", "content": str(a + 5)}]}
        for a in (7, 8)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def trainer_with(model_dir: Path, dataset: Path | None, **trainer: Any) -> PolicyTrainer:
    settings: dict[str, Any] = {"optim": {"lr": 1e-2, "grad_clip": 1e9}, **trainer}
    if dataset is not None:
        settings["sft"] = {"dataset": str(dataset), "coef": 0.5, "batch_size": 4, **settings.get("sft", {})}
    config = parse_config(
        {"run": "t", "groups_per_step": 2, "samples_per_group": 4, "rollout": {"temperature": 0.8}, "trainer": settings}
    )
    return PolicyTrainer(model_dir, config)


def zero_advantage_groups() -> list[Any]:
    """Two groups whose samples all earned reward 1: every advantage is 0, so the RL term has no gradient."""
    return [train("t", 0), train("t", 1)]


def weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_the_supervised_loss_falls_while_rl_trains(tiny, dataset):
    trainer = trainer_with(tiny, dataset, mini_batches=2, sft={"batch_size": 12})  # each update: the whole dataset
    groups = engine_groups(TorchEngine(tiny), ["1+2=", "3+4="], n=4)  # rewards 0, 1, 0, 1: RL has a signal
    batch = make_batch(groups)
    rewarded = torch.tensor([k % 2 == 1 for k in range(4)] * 2)

    def seq_logp() -> torch.Tensor:
        with torch.no_grad():
            return (token_logprobs(trainer.model, batch.ids, batch.attention, 0.8) * batch.mask).sum(-1)

    before = seq_logp()
    steps = [trainer.step(groups) for _ in range(4)]
    after = seq_logp()
    losses = [m["sft_loss"] for m in steps]
    assert losses[-1] < 0.7 * losses[0] and losses == sorted(losses, reverse=True), losses
    assert all(m["updates"] == 2.0 and 0 < m["sft_s"] < m["train_s"] for m in steps), steps
    gained = (after - before)[rewarded].mean() - (after - before)[~rewarded].mean()
    assert gained > 0, (before, after)  # the RL term still moves the policy toward the rewarded samples


def test_with_zero_advantages_only_the_supervised_term_moves_the_weights(tiny, dataset):
    plain = trainer_with(tiny, None)
    start = weights(plain)
    metrics = plain.step(zero_advantage_groups())
    assert metrics["grad_norm"] == 0.0 and "sft_loss" not in metrics
    assert all(torch.equal(start[k], v) for k, v in weights(plain).items())

    mixed = trainer_with(tiny, dataset)
    assert isinstance(mixed.sft, SftMix)
    metrics = mixed.step(zero_advantage_groups())
    assert any(not torch.equal(start[k], v) for k, v in weights(mixed).items())

    # The same rows' mean cross-entropy, computed apart on the starting weights: the step's gradient is coef x its own.
    reference = trainer_with(tiny, None)
    chosen = [mixed.sft.examples[i] for i in rows_of_update(0, 4, len(mixed.sft.examples), seed=0)]
    logp, mask = supervised_logprobs(reference, chosen)
    ce = -(logp * mask).sum() / mask.sum()
    ce.backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in reference.model.parameters() if p.grad is not None))
    assert metrics["sft_loss"] == pytest.approx(float(ce.detach()), rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(0.5 * norm, rel=1e-4)


def test_micro_batches_give_the_supervised_term_of_one_pass(tiny, dataset):
    one = trainer_with(tiny, dataset, compute={"micro_batch_tokens": None}, sft={"batch_size": 12})
    many = trainer_with(tiny, dataset, compute={"micro_batch_tokens": 16}, sft={"batch_size": 12})  # 2-3 rows each
    a, b = one.step(zero_advantage_groups()), many.step(zero_advantage_groups())
    assert a["sft_loss"] == pytest.approx(b["sft_loss"], rel=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # The gradients the update took (the step leaves them in place); the weights after Adam's first step would follow
    # the sign of a near-zero component, which summation order may flip.
    grads = {n: p.grad for n, p in many.model.named_parameters()}
    for name, param in one.model.named_parameters():
        assert param.grad is not None and torch.allclose(param.grad, grads[name], atol=1e-6), name


def test_a_restored_trainer_goes_on_with_the_rows_after_its_checkpoint(tiny, dataset):
    straight = trainer_with(tiny, dataset)
    for _ in range(3):
        straight.step(zero_advantage_groups())

    first = trainer_with(tiny, dataset)
    for _ in range(2):
        first.step(zero_advantage_groups())
    saved = first.checkpoints.to_bytes({})
    restored = trainer_with(tiny, dataset)
    restored.checkpoints.restore(saved)
    assert restored.scheduler.last_epoch == 2  # the update count, which places the next rows in the order
    restored.step(zero_advantage_groups())
    for name, tensor in weights(straight).items():
        assert torch.allclose(tensor, weights(restored)[name], atol=1e-6), name

    again = trainer_with(tiny, dataset)  # the control: two steps and a third from the start of the order
    for _ in range(2):
        again.step(zero_advantage_groups())
    again.scheduler.last_epoch = 0
    again.step(zero_advantage_groups())
    assert any(not torch.allclose(t, weights(again)[k], atol=1e-6) for k, t in weights(straight).items())

"""The step cut into micro-batches and mini-batches: exact gradient accumulation, moving PPO ratios, lr schedule."""

from __future__ import annotations

import math

import pytest
import torch

from schemas import TrainGroup, WireTensor
from tests.workers.test_trainer import engine_groups
from workers.config import parse_config
from workers.data.models import materialize
from workers.engines.torch_engine import TorchEngine
from workers.training.microbatch import pack, split_even
from workers.training.optim import lr_multiplier, param_groups
from workers.training.trainer import PolicyTrainer

pytestmark = pytest.mark.workers

PROMPTS = ["1+2=", "9+9=", "4+0=", "7+3="]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = materialize("tiny:64x2", tmp_path_factory.mktemp("m") / "m", seed=4)
    groups = [_varied(g, i) for i, g in enumerate(engine_groups(TorchEngine(model_dir), PROMPTS, n=4))]
    lengths = {
        len(g.scored.rollout.prompt_token_ids.to_values()) + s.token_ids.numel
        for g in groups
        for s in g.scored.rollout.samples
    }
    assert len(lengths) > 1, "the responses should differ in length, so micro-batches differ in width"
    return model_dir, groups


def _varied(group: TrainGroup, i: int) -> TrainGroup:
    """The group with its samples cut to 1..5 tokens (a random tiny model rarely stops early by itself)."""
    rollout = group.scored.rollout
    samples = []
    for k, s in enumerate(rollout.samples):
        keep = 1 + (i + 2 * k) % 5
        ids, lps = list(s.token_ids.to_values())[:keep], list(s.logprobs.to_values())[:keep]
        samples.append(
            s.model_copy(
                update={
                    "token_ids": WireTensor.from_values(ids, "int32"),
                    "logprobs": WireTensor.from_values(lps, "float32"),
                }
            )
        )
    scored = group.scored.model_copy(update={"rollout": rollout.model_copy(update={"samples": tuple(samples)})})
    return group.model_copy(update={"scored": scored})


def trainer(model_dir, **trainer_options) -> PolicyTrainer:
    optim = {"lr": 1e-2, "grad_clip": 1e9, **trainer_options.pop("optim", {})}
    options = {"optim": optim, "kl": {"coef": 0.0}, **trainer_options}
    config = parse_config(
        {
            "run": "mb",
            "groups_per_step": len(PROMPTS),
            "samples_per_group": 4,
            "rollout": {"temperature": 0.8, "max_new_tokens": 5},
            "trainer": options,
        }
    )
    return PolicyTrainer(model_dir, config)


def gradients(model_dir, groups, **options) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The gradient of one step's loss (the optimizer is kept from moving the weights)."""
    t = trainer(model_dir, **options)
    t.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]
    metrics = t.step(groups)
    return {n: p.grad.detach().clone() for n, p in t.model.named_parameters() if p.grad is not None}, metrics


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_accumulated_micro_batches_give_the_one_pass_gradient(setup, aggregation):
    model_dir, groups = setup
    whole, m_whole = gradients(model_dir, groups, compute={"micro_batch_tokens": None}, aggregation=aggregation)
    split, m_split = gradients(model_dir, groups, compute={"micro_batch_tokens": 12}, aggregation=aggregation)
    assert whole.keys() == split.keys() and whole
    worst = max(float((whole[n] - split[n]).abs().max()) for n in whole)
    assert worst < 1e-6, f"largest gradient difference {worst:.2e}"
    assert max(float(g.abs().max()) for g in whole.values()) > 1e-3, "a zero gradient would make this vacuous"
    assert m_whole["loss"] == pytest.approx(m_split["loss"], abs=1e-6)
    assert m_whole["grad_norm"] == pytest.approx(m_split["grad_norm"], rel=1e-5)


def test_one_update_never_clips_and_several_updates_do(setup):
    model_dir, groups = setup
    once = trainer(model_dir).step(groups)
    assert once["updates"] == 1 and once["ppo_clip_frac"] == 0.0 and once["ratio_mean"] == pytest.approx(1.0)
    many = trainer(model_dir, mini_batches=2, ppo_epochs=3, optim={"lr": 3e-2}).step(groups)
    assert many["updates"] == 6
    assert many["ppo_clip_frac"] > 0, many
    assert many["ratio_mean"] != pytest.approx(1.0, abs=1e-4)


def test_first_of_several_updates_matches_the_single_update(setup):
    """The old-policy log-probs computed before the first update equal that update's own forward."""
    model_dir, groups = setup
    one = trainer(model_dir, compute={"micro_batch_tokens": None})
    one.step(groups)
    first = trainer(model_dir, compute={"micro_batch_tokens": None}, ppo_epochs=2)
    first.optimizer.step = _only_first(first.optimizer.step)  # type: ignore[method-assign]
    first.step(groups)
    for (name, a), b in zip(one.model.named_parameters(), first.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def _only_first(step):
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs) if len(calls) == 1 else None

    return wrapped


def test_pack_bounds_padded_tokens_and_keeps_every_row():
    lengths = [5, 9, 3, 9, 4, 20, 1]
    groups = pack(lengths, budget=18)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        padded = len(g) * max(lengths[i] for i in g)
        assert padded <= 18 or len(g) == 1, (g, padded)
    assert [5] in groups, "a sequence longer than the budget goes alone"
    assert pack(lengths, None) == [sorted(range(7), key=lambda i: (-lengths[i], i))]
    assert pack([], 10) == []


def test_split_even_covers_the_rows():
    assert [list(r) for r in split_even(7, 3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(r) for r in split_even(1, 2)] == [1, 0]
    with pytest.raises(ValueError):
        split_even(3, 0)


def test_lr_schedules():
    constant = lr_multiplier("constant", warmup=2, total=10)
    assert [constant(u) for u in range(4)] == [0.5, 1.0, 1.0, 1.0]
    linear = lr_multiplier("linear", warmup=0, total=10, min_ratio=0.1)
    assert linear(0) == 1.0 and linear(5) == pytest.approx(0.55) and linear(10) == pytest.approx(0.1)
    cosine = lr_multiplier("cosine", warmup=0, total=4)
    assert [round(cosine(u), 6) for u in range(5)] == [
        1.0,
        round((1 + math.cos(math.pi / 4)) / 2, 6),
        0.5,
        round((1 + math.cos(3 * math.pi / 4)) / 2, 6),
        0.0,
    ]
    with pytest.raises(ValueError):
        lr_multiplier("step", 0, 1)


def test_schedule_runs_per_update_and_survives_a_checkpoint(setup):
    model_dir, groups = setup
    t = trainer(model_dir, schedule={"kind": "linear"}, steps=4, mini_batches=2)
    first = t.step(groups)
    assert first["lr"] == pytest.approx(1e-2 * (1 - 2 / 8))
    restored = trainer(model_dir, schedule={"kind": "linear"}, steps=4, mini_batches=2)
    restored.checkpoints.restore(t.checkpoints.to_bytes({"step": 1}))
    assert restored.step(groups)["lr"] == pytest.approx(t.step(groups)["lr"]) == pytest.approx(1e-2 * 0.5)


def test_weight_decay_skips_norms_and_biases(setup):
    model_dir, _ = setup
    t = trainer(model_dir, optim={"weight_decay": 0.1})
    decayed, plain = param_groups(t.model, 0.1)
    names = {id(p): n for n, p in t.model.named_parameters()}
    assert all("norm" in names[id(p)] for p in plain["params"]) and plain["weight_decay"] == 0.0  # type: ignore[union-attr]
    assert all(p.dim() >= 2 for p in decayed["params"]) and decayed["weight_decay"] == 0.1  # type: ignore[union-attr]
    assert [g["weight_decay"] for g in t.optimizer.param_groups] == [0.1, 0.0]


def test_a_config_whose_batches_do_not_fit_is_refused():
    from relax_bus.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        parse_config(
            {
                "run": "mb",
                "groups_per_step": 1,
                "samples_per_group": 2,
                "rollout": {"max_new_tokens": 32},
                "trainer": {"mini_batches": 3, "compute": {"micro_batch_tokens": 16}},
            }
        )
    text = str(err.value)
    assert "mini_batches (3) exceeds the 2 sequences" in text and "micro_batch_tokens (16)" in text

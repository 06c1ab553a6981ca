"""On-policy distillation: the per-token advantage, the policy loss on [B, T] advantages, the trainer's step with
a teacher's log-probs, the teacher's worker function, and the config's chain and checks."""

from __future__ import annotations

import math

import pytest
import torch

from relax_bus.settings import ConfigError
from schemas import TrainGroup, WireTensor
from tests.workers.test_trainer import engine_groups
from workers.config import parse_config
from workers.data.models import load_model, load_tokenizer, materialize
from workers.data.tokenizer import tokenizer_mismatch
from workers.engines.torch_engine import TorchEngine
from workers.preflight import preflight
from workers.roles.reference import replayed_logprobs
from workers.training.batch import make_batch, untrainable
from workers.training.distill import DistillTerm, StepTokens, distill_advantages, group_baseline, reverse_kl
from workers.training.logprobs import token_logprobs
from workers.training.policy_losses import POLICY_LOSSES, LossSettings, policy_loss
from workers.training.trainer import PolicyTrainer

pytestmark = pytest.mark.workers


# ---- the math ----------------------------------------------------------------------------------------------------


def test_the_advantage_is_the_teacher_minus_the_sampling_log_prob_plus_the_weighted_reward_advantage():
    teacher = torch.tensor([[-0.5, -1.0, 7.0], [-2.0, -0.1, -0.3]])
    sampling = torch.tensor([[-1.5, -0.5, float("nan")], [-1.0, -0.1, -0.8]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    seq = torch.tensor([2.0, -1.0])
    adv = distill_advantages(seq, teacher, sampling, mask, coef=0.5, reward_coef=0.25)
    expected = torch.tensor([[0.5 * 1.0 + 0.5, 0.5 * -0.5 + 0.5, 0.0], [0.5 * -1.0 - 0.25, -0.25, 0.5 * 0.5 - 0.25]])
    assert torch.allclose(adv, expected)
    assert reverse_kl(teacher, sampling, mask) == pytest.approx((-1.0 + 0.5 + 1.0 + 0.0 - 0.5) / 5)


def test_the_group_baseline_is_the_mean_of_the_groups_other_rows_at_each_position():
    values = torch.tensor([[1.0, 2.0, 5.0], [3.0, 4.0, 9.0], [-4.0, 6.0, float("nan")], [7.0, 8.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1]])
    base = group_baseline(values, mask, [0, 0, 0, 1])  # rows 0-2 answer one prompt, row 3 another
    expected = torch.tensor([[-0.5, 5.0, 0.0], [-1.5, 4.0, 0.0], [2.0, 3.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(base, expected)  # row 0 at t=2: no other valid row; row 3: alone in its group
    assert torch.equal(group_baseline(values, mask, [5, 5, 5, 2]), expected)  # any ids, the same groups


def test_the_group_baseline_ignores_the_rows_own_value_and_centres_a_full_group():
    gen = torch.Generator().manual_seed(0)
    values, mask = torch.randn(6, 4, generator=gen), torch.ones(6, 4)
    groups = [0, 1, 0, 1, 0, 1]  # rows of a group need not be adjacent
    base = group_baseline(values, mask, groups)
    moved = values.clone()
    moved[2] += 100.0
    assert torch.equal(group_baseline(moved, mask, groups)[2], base[2])  # independent of its own sample: unbiased
    centred = values - base
    for g in (0, 1):
        rows = [i for i, x in enumerate(groups) if x == g]
        assert torch.allclose(centred[rows].sum(dim=0), torch.zeros(4), atol=1e-6)


def test_the_distill_term_subtracts_the_group_baseline_unless_told_not_to():
    teacher = torch.tensor([[-0.1, -0.2], [-9.0, -0.3], [-8.0, -0.1]])
    sampling = torch.tensor([[-2.0, -0.1], [-1.0, -0.2], [-0.5, -0.3]])
    mask, seq, groups = torch.ones(3, 2), torch.zeros(3), [0, 0, 0]
    plain, metrics = DistillTerm(1.0, 0.0, baseline="none")(seq, StepTokens(sampling, mask, groups, teacher))
    assert torch.allclose(plain, teacher - sampling)
    centred, _ = DistillTerm(1.0, 0.0)(seq, StepTokens(sampling, mask, groups, teacher))
    gap = teacher - sampling
    assert torch.allclose(centred, gap - group_baseline(gap, mask, groups))
    assert centred[0, 0] > plain[0, 0] > 0 > centred[1, 0] > plain[1, 0]  # the right token among wrong ones gains
    assert metrics["distill_reverse_kl"] == pytest.approx(float(-gap.mean()))
    with pytest.raises(ValueError, match="baseline"):
        DistillTerm(1.0, 0.0, baseline="batch")


def test_shapes_are_checked():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="seq_adv"):
        distill_advantages(torch.zeros(3), torch.zeros(2, 3), torch.zeros(2, 3), mask, 1.0, 0.0)
    with pytest.raises(ValueError, match="teacher_logp"):
        distill_advantages(torch.zeros(2), torch.zeros(2, 4), torch.zeros(2, 3), mask, 1.0, 0.0)
    with pytest.raises(ValueError, match="group_of"):
        group_baseline(torch.zeros(2, 3), mask, [0])


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
def test_per_token_advantages_equal_to_the_sequence_advantage_give_the_same_loss_and_gradient(loss):
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=gen) * 2).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(3, 5, generator=gen)
    rollout = old + 0.05 * torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    seq = torch.tensor([0.7, -1.3, 0.2])
    settings = LossSettings(loss=loss)
    a, _ = policy_loss(logp, old, rollout, seq, mask, settings)
    (ga,) = torch.autograd.grad(a, logp)
    b, _ = policy_loss(logp, old, rollout, seq.unsqueeze(1).expand(3, 5), mask, settings)
    (gb,) = torch.autograd.grad(b, logp)
    assert torch.allclose(a, b) and torch.allclose(ga, gb)


def test_a_token_advantage_moves_only_its_token():
    logp = torch.full((1, 4), -1.0, requires_grad=True)
    mask = torch.ones(1, 4)
    adv = torch.tensor([[0.0, 2.0, 0.0, 0.0]])
    loss, _ = policy_loss(logp, logp.detach(), logp.detach(), adv, mask, LossSettings(loss="ppo", correction="none"))
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 1] < 0 and torch.count_nonzero(grad) == 1  # descending raises that token's log-prob only


def test_advantages_of_another_shape_are_refused():
    logp = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        policy_loss(logp, logp.detach(), logp.detach(), torch.zeros(2, 4), torch.ones(2, 3))


# ---- the trainer and the teacher's worker function ---------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    student = materialize("tiny:64x2", root / "student", seed=5)
    teacher = materialize("tiny:64x2", root / "teacher", seed=9)
    groups = engine_groups(TorchEngine(student), ["1+2=", "3+4="], n=4)
    return student, teacher, groups


def config(**more):
    return parse_config(
        {
            "run": "distill",
            "groups_per_step": 2,
            "samples_per_group": 4,
            "rollout": {"temperature": 0.8, "max_new_tokens": 5},
            "trainer": {"optim": {"lr": 1e-2}},
            **more,
        }
    )


def taught(groups: list[TrainGroup], teacher_dir) -> list[TrainGroup]:
    """The groups with the teacher's log-probs, computed as the teacher role computes them."""
    model = load_model(teacher_dir)
    out = []
    for g in groups:
        with torch.no_grad():
            logps = replayed_logprobs(model, g.scored.rollout, 0.8, replay=False)
        tensors = tuple(WireTensor.from_values(lp.tolist(), "float32") for lp in logps)
        out.append(g.model_copy(update={"teacher_logprobs": tensors}))
    return out


def test_the_teacher_log_probs_are_the_teachers_teacher_forced_ones(models):
    _, teacher_dir, groups = models
    (group, *_) = taught(groups, teacher_dir)
    batch = make_batch([group])
    with torch.no_grad():
        forced = token_logprobs(load_model(teacher_dir), batch.ids, batch.attention, 0.8)  # [N, T-1]
    valid = batch.mask.bool()
    assert batch.teacher_logp is not None
    assert torch.allclose(batch.teacher_logp[valid], forced[valid], atol=1e-4)
    assert float(batch.teacher_logp[~valid].abs().sum()) == 0.0


def test_a_step_trains_on_the_teachers_advantage_even_where_every_reward_is_equal(models):
    student, teacher_dir, groups = models
    flat = [g.model_copy(update={"scored": g.scored.model_copy(update={"rewards": (1.0,) * 4})}) for g in groups]
    plain = PolicyTrainer(student, config())
    before = {n: p.detach().clone() for n, p in plain.model.named_parameters()}
    plain.step(flat)
    still = max(float((p.detach() - before[n]).abs().max()) for n, p in plain.model.named_parameters())
    assert still == 0.0  # GRPO: equal rewards, zero advantage, no update
    distilling = PolicyTrainer(student, config(teacher={"source": str(teacher_dir)}))
    metrics = distilling.step(taught(flat, teacher_dir))
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in distilling.model.named_parameters())
    assert moved > 0.0
    assert math.isfinite(metrics["distill_reverse_kl"]) and metrics["distill_reverse_kl"] != 0.0


def sharpened(source, out, factor: float):
    """A model directory of `source`'s model with its logits scaled by `factor` (its final norm's weight): a teacher
    far more certain than a freshly built student."""
    model = load_model(source)
    with torch.no_grad():
        model.model.norm.weight.mul_(factor)
    model.save_pretrained(out)
    load_tokenizer(source).save_pretrained(out)
    return out


def test_distilling_lowers_the_exact_reverse_kl_to_the_teacher(models, tmp_path):
    """One-token responses, so the reverse KL at the first position is the whole objective and is computed exactly
    over the vocabulary, not estimated from samples."""
    student, teacher_src, _ = models
    teacher_dir = sharpened(teacher_src, tmp_path / "sharp", 4.0)
    cfg = config(teacher={"source": str(teacher_dir)}, samples_per_group=64)
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"max_new_tokens": 1})})
    trainer = PolicyTrainer(student, cfg)
    teacher, engine = load_model(teacher_dir), TorchEngine(student)

    def sampled(version: int, seed: int) -> list[TrainGroup]:
        engine.load_state_dict({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, version)
        return taught(engine_groups(engine, ["1+2=", "3+4="], n=64, seed=seed, max_new_tokens=1), teacher_dir)

    fixed = make_batch(sampled(0, seed=100))

    def exact_reverse_kl() -> float:
        with torch.no_grad():
            mine = torch.log_softmax(trainer.model(input_ids=fixed.ids).logits[:, :-1] / 0.8, dim=-1)
            theirs = torch.log_softmax(teacher(input_ids=fixed.ids).logits[:, :-1] / 0.8, dim=-1)
            kl = (mine.exp() * (mine - theirs)).sum(dim=-1)  # [N, T-1]
        return float((kl * fixed.mask).sum() / fixed.mask.sum())

    first = exact_reverse_kl()
    for step in range(8):
        trainer.step(sampled(step, seed=step))
    last = exact_reverse_kl()
    assert last < 0.6 * first, (first, last)


def test_a_group_without_the_teachers_log_probs_is_untrainable_in_a_distilling_run(models):
    student, teacher_dir, groups = models
    trainer = PolicyTrainer(student, config(teacher={"source": str(teacher_dir)}))
    assert "no teacher log-probs" in (trainer.untrainable(groups[0]) or "")
    good = taught(groups[:1], teacher_dir)[0]
    assert trainer.untrainable(good) is None
    short = good.model_copy(update={"teacher_logprobs": (WireTensor.from_values([0.0], "float32"),) * 4})
    assert "teacher log-probs for" in (untrainable(short, 259) or "")
    nan = good.model_copy(
        update={
            "teacher_logprobs": tuple(
                WireTensor.from_values([math.nan] * t.numel, "float32") for t in good.teacher_logprobs or ()
            )
        }
    )
    assert "teacher log-prob not finite" in (untrainable(nan, 259) or "")


# ---- the config -------------------------------------------------------------------------------------------------


def test_the_teacher_sits_after_the_reward_and_after_the_reference_when_there_is_one():
    plain = config(teacher={"source": "tiny"})
    assert [(r.name, r.input, r.output) for r in plain.chain][2:4] == [
        ("reward", "rollouts", "scored"),
        ("teacher", "scored", "train"),
    ]
    with_kl = config(teacher={"source": "tiny"}, trainer={"kl": {"coef": 0.1}})
    assert [(r.name, r.input, r.output) for r in with_kl.chain][2:5] == [
        ("reward", "rollouts", "scored"),
        ("reference", "scored", "teach"),
        ("teacher", "teach", "train"),
    ]
    assert plain.hops == with_kl.hops == config().hops  # a run's streams do not depend on its roles
    assert "teacher" not in [r.name for r in config().chain]


@pytest.mark.parametrize(
    ("section", "problem"),
    [
        ({"source": "tiny", "coef": 0}, "teacher.coef"),
        ({"source": "tiny", "reward_coef": -1}, "teacher.reward_coef"),
        ({"coef": 1.0}, "teacher.source"),
    ],
)
def test_teacher_mistakes_are_refused(section, problem):
    with pytest.raises(ConfigError, match=problem):
        config(teacher=section)


def test_a_teacher_count_in_a_run_without_a_teacher_is_refused():
    with pytest.raises(ConfigError, match="no teacher role"):
        config(roles={"teacher": 2})


def test_a_teacher_directory_not_built_yet_is_refused_in_one_line_saying_how_to_build_it(tmp_path):
    missing = tmp_path / "teacher-demo"
    distilling = config(teacher={"source": str(missing)}, model={"source": "tiny:64x2"})
    with pytest.raises(ConfigError) as err:
        preflight(distilling, tmp_path / "work", ("model", "teacher"))
    assert err.value.problems == [
        f"teacher.source: no model directory at {missing}: write one first, e.g. a warmed-up policy with "
        f"`relax model warmup CONFIG --out {missing}` (docs/algorithms.md, On-policy distillation)"
    ]
    materialize("tiny:64x2", missing, seed=3)  # built: the same check passes
    preflight(distilling, tmp_path / "work", ("model", "teacher"))


def test_tokenizers_that_read_ids_differently_are_told_apart(tmp_path):
    byte = load_tokenizer(materialize("tiny:64x2", tmp_path / "a"))
    assert tokenizer_mismatch(byte, load_tokenizer(materialize("tiny:128x2", tmp_path / "b"))) is None
    other = load_tokenizer(materialize("tiny:64x2", tmp_path / "c"))
    other.add_tokens(["<tool>"])
    assert "vocabularies differ" in (tokenizer_mismatch(byte, other) or "")
    templated = load_tokenizer(materialize("tiny:64x2", tmp_path / "d"))
    templated.chat_template = "{{ messages }}"
    assert tokenizer_mismatch(byte, templated) == "the chat templates differ"

"""PPO with GAE: the advantages and returns against hand-computed ones, PPO's clipped value loss, the explained
variance, the critic's update and its checkpoint (exactly once over a restart), the trainer's step on the critic's
values, and the config's chain and refusals."""

from __future__ import annotations

import math

import pytest
import torch

from relax_bus.settings import ConfigError
from schemas import CriticValues, TrainGroup, WireTensor
from tests.workers.test_trainer import engine_groups
from workers.config import CriticConfig, parse_config
from workers.data.models import load_model, materialize
from workers.engines.torch_engine import TorchEngine
from workers.roles.critic import CriticState, group_key
from workers.training.batch import make_batch, untrainable
from workers.training.distill import StepTokens
from workers.training.gae import GaeTerm, clipped_value_loss, explained_variance, gae
from workers.training.step_metrics import critic_metrics
from workers.training.trainer import PolicyTrainer
from workers.training.value_model import CriticTrainer

pytestmark = pytest.mark.workers


# ---- the math ----------------------------------------------------------------------------------------------------


def test_gae_matches_a_hand_computed_example():
    # One row, three valid tokens after one prompt position; R = 1, gamma 0.9, lam 0.5.
    values = torch.tensor([[9.0, 0.2, 0.5, 0.4]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    adv, ret = gae(torch.tensor([1.0]), values, mask, gamma=0.9, lam=0.5)
    d3 = 1.0 - 0.4  # the last token: the reward, no next state
    d2 = 0.0 + 0.9 * 0.4 - 0.5
    d1 = 0.0 + 0.9 * 0.5 - 0.2
    a3 = d3
    a2 = d2 + 0.45 * a3
    a1 = d1 + 0.45 * a2
    assert torch.allclose(adv, torch.tensor([[0.0, a1, a2, a3]]))
    assert torch.allclose(ret, torch.tensor([[0.0, a1 + 0.2, a2 + 0.5, a3 + 0.4]]))


def test_gamma_and_lambda_at_their_bounds():
    values = torch.tensor([[0.3, 0.6, 0.1], [0.5, -0.2, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = torch.tensor([2.0, -1.0])
    # gamma = lam = 1: the Monte-Carlo return minus the value, every token.
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    assert torch.allclose(adv, torch.tensor([[1.7, 1.4, 1.9], [-1.5, -0.8, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]))
    # lam = 0: the one-step TD error.
    adv, _ = gae(rewards, values, mask, 1.0, 0.0)
    assert torch.allclose(adv, torch.tensor([[0.3, -0.5, 1.9], [-0.7, -0.8, 0.0]]))
    # gamma = 0: only the last token sees the reward; every other token's target is 0.
    adv, ret = gae(rewards, values, mask, 0.0, 1.0)
    assert torch.allclose(adv, torch.tensor([[-0.3, -0.6, 1.9], [-0.5, -0.8, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[0.0, 0.0, 2.0], [0.0, -1.0, 0.0]]))


def test_masked_positions_are_stepped_over_and_stay_zero():
    values = torch.tensor([[0.5, float("nan"), 0.25, float("inf")]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    adv, ret = gae(torch.tensor([1.0]), values, mask, 1.0, 1.0)
    # The hole is not the end: token 0's next state is token 2.
    assert torch.allclose(adv, torch.tensor([[0.5, 0.0, 0.75, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    adv, _ = gae(torch.tensor([1.0]), values, torch.zeros(1, 4), 0.9, 0.9)
    assert float(adv.abs().sum()) == 0.0  # a row without a valid token (a failed reward) has no advantage


def test_gae_checks_shapes():
    with pytest.raises(ValueError, match="rewards"):
        gae(torch.zeros(3), torch.zeros(2, 4), torch.ones(2, 4), 1.0, 1.0)
    with pytest.raises(ValueError, match="values"):
        gae(torch.zeros(2), torch.zeros(2, 3), torch.ones(2, 4), 1.0, 1.0)


def test_the_value_loss_takes_the_larger_of_the_clipped_and_unclipped_errors():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, -1.0]])
    values = torch.tensor([[0.5, 2.0, 0.1]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    loss, frac = clipped_value_loss(values, old, returns, mask, clip=0.2)
    # token 0: (0.5-1)^2 = .25 vs (0.2-1)^2 = .64 -> .64 (clipped); token 1: (2-1)^2 = 1 vs (0.2-1)^2 = .64 -> 1;
    # token 2: (0.1+1)^2 = 1.21 vs the same (inside the clip) -> 1.21
    assert float(loss) == pytest.approx(0.5 * (0.64 + 1.0 + 1.21) / 3)
    assert frac == pytest.approx(1 / 3)
    (grad,) = torch.autograd.grad(loss, values)
    assert grad[0, 0] == 0.0  # the clipped branch carries no gradient to V
    assert grad[0, 1] > 0 and grad[0, 2] > 0


def test_the_value_loss_ignores_padding_and_is_plain_mse_inside_the_clip():
    values = torch.tensor([[0.1, float("nan")]], requires_grad=True)
    loss, frac = clipped_value_loss(
        values, torch.zeros(1, 2), torch.tensor([[0.3, 5.0]]), torch.tensor([[1.0, 0.0]]), 1
    )
    assert float(loss) == pytest.approx(0.5 * 0.04) and frac == 0.0


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 4), 2.5), returns, mask) == pytest.approx(0.0)
    assert explained_variance(torch.zeros(1, 4), torch.ones(1, 4), mask) == 0.0  # Var(R) = 0
    assert explained_variance(-returns, returns, mask) < 0


# ---- the critic's update and checkpoint ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = materialize("tiny:64x2", tmp_path_factory.mktemp("critic") / "m", seed=5)
    groups = engine_groups(TorchEngine(model_dir), ["1+2=", "3+4=", "5+1=", "2+2="], n=4)
    return model_dir, groups


def test_the_critic_learns_the_returns_of_a_group(setup):
    model_dir, groups = setup
    trainer = CriticTrainer(load_model(model_dir), CriticConfig(lr=3e-3, gamma=1.0, lam=1.0))
    first = trainer.train(groups[0])
    assert first.version == 0 and trainer.version == 1
    assert first.value_mean == 0.0  # the head starts at 0
    assert [v.numel for v in first.values] == [s.token_ids.numel for s in groups[0].scored.rollout.samples]
    losses = [trainer.train(groups[0]).value_loss for _ in range(30)]
    assert losses[-1] < 0.2 * first.value_loss, (first.value_loss, losses)


def test_a_restored_critic_trains_the_groups_after_its_checkpoint_into_the_same_weights(setup):
    """Exactly once in effect: a critic killed after its checkpoint trains the groups it had not checkpointed again,
    from the checkpoint's weights and optimizer, into the weights its predecessor reached; the ledger says which
    groups are copies."""
    model_dir, groups = setup
    config = CriticConfig(lr=3e-3, updates=2)
    first = CriticTrainer(load_model(model_dir), config)
    state = CriticState()
    for g in groups[:2]:
        first.train(g)
        state.trained.add(group_key(g))
    data = first.to_bytes(state.to_extra())
    after = [first.train(g) for g in groups[2:]]  # then SIGKILL: no checkpoint holds these
    second = CriticTrainer(load_model(model_dir), config)
    restored = CriticState.from_extra(second.restore(data))
    assert second.version == 2 and restored.trained == {group_key(g) for g in groups[:2]}
    redelivered = [g for g in groups if group_key(g) not in restored.trained]
    assert redelivered == groups[2:]
    again = [second.train(g) for g in redelivered]
    assert [a.version for a in again] == [a.version for a in after] == [2, 3]
    for a, b in zip(after, again, strict=True):
        assert a.value_loss == pytest.approx(b.value_loss, rel=1e-5)
    for (name, p), q in zip(first.model.state_dict().items(), second.model.state_dict().values(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name


def test_a_checkpoint_of_something_else_is_refused(setup):
    from workers.errors import CheckpointRefused

    model_dir, _ = setup
    with pytest.raises(CheckpointRefused):
        CriticTrainer(load_model(model_dir), CriticConfig()).restore(b"not a checkpoint")


# ---- the actor's side -----------------------------------------------------------------------------------------


def config(**more):
    return parse_config(
        {
            "run": "ppo",
            "groups_per_step": 2,
            "samples_per_group": 4,
            "rollout": {"temperature": 0.8, "max_new_tokens": 5},
            "trainer": {"optim": {"lr": 1e-2}, "advantage": "gae"},
            "critic": {"gamma": 1.0, "lam": 1.0},
            **more,
        }
    )


def valued(groups: list[TrainGroup], value: float) -> list[TrainGroup]:
    """The groups with a constant critic value on every token."""
    out = []
    for g in groups:
        values = tuple(WireTensor.from_values([value] * s.token_ids.numel, "float32") for s in g.scored.rollout.samples)
        critic = CriticValues(version=0, values=values, value_loss=0.0, value_mean=value, explained_variance=0.0)
        out.append(g.model_copy(update={"critic": critic}))
    return out


def test_the_batch_lays_the_values_out_as_the_mask(setup):
    _, groups = setup
    batch = make_batch(valued(groups[:2], 0.25))
    assert batch.values is not None
    valid = batch.mask.bool()
    assert bool((batch.values[valid] == 0.25).all()) and float(batch.values[~valid].abs().sum()) == 0.0
    cut = batch.rows([0, 1], torch.device("cpu"))
    assert cut.values is not None and cut.values.shape == cut.mask.shape


def test_gae_advantages_reach_the_loss_per_token():
    term = GaeTerm(gamma=1.0, lam=1.0)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    values = torch.tensor([[0.0, 0.25, 0.5]])
    adv, metrics = term(torch.ones(1), StepTokens(torch.zeros(1, 3), mask, [0], values=values))  # reward 1
    assert torch.allclose(adv, torch.tensor([[0.0, 0.75, 0.5]]))
    assert metrics["gae_advantage_mean"] == pytest.approx(0.625)
    with pytest.raises(ValueError, match="critic's values"):
        term(torch.ones(1), StepTokens(torch.zeros(1, 3), mask, [0]))


def test_a_step_trains_on_gae_where_grpo_would_see_no_signal(setup):
    """Equal rewards: GRPO's advantage is 0 everywhere, GAE's is R - V with a critic that says 0.5."""
    model_dir, groups = setup
    flat = [g.model_copy(update={"scored": g.scored.model_copy(update={"rewards": (1.0,) * 4})}) for g in groups[:2]]
    trainer = PolicyTrainer(model_dir, config())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.step(valued(flat, 0.5))
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in trainer.model.named_parameters())
    assert moved > 0.0 and metrics["gae_advantage_mean"] == pytest.approx(0.5)
    assert metrics["explained_variance"] == 0.0  # every return is 1: Var(R) = 0
    assert "no critic values" in (trainer.untrainable(flat[0]) or "")
    assert trainer.untrainable(valued(flat, 0.5)[0]) is None


def test_the_steps_explained_variance_is_over_the_batchs_tokens(setup):
    model_dir, groups = setup  # rewards 0, 1, 0, 1 in every group
    trainer = PolicyTrainer(model_dir, config())
    metrics = trainer.step(valued(groups[:2], 0.5))  # V = 0.5 everywhere: no better than the mean
    assert metrics["explained_variance"] == pytest.approx(0.0, abs=1e-6)
    perfect = []
    for g in groups[:2]:
        rows = zip(g.scored.rollout.samples, g.scored.rewards, strict=True)
        values = tuple(WireTensor.from_values([r] * s.token_ids.numel, "float32") for s, r in rows)
        info = CriticValues(version=0, values=values, value_loss=0.0, value_mean=0.5, explained_variance=1.0)
        perfect.append(g.model_copy(update={"critic": info}))
    assert trainer.step(perfect)["explained_variance"] == pytest.approx(1.0)  # V = R on every token


def test_the_step_logs_the_critics_figures_of_its_groups(setup):
    _, groups = setup
    a, b = valued(groups[:1], 0.5)[0], valued(groups[1:2], 0.25)[0]
    assert a.critic is not None and b.critic is not None
    b = b.model_copy(update={"critic": b.critic.model_copy(update={"version": 7, "value_loss": 0.5})})
    assert critic_metrics([a, b]) == {"value_loss": 0.25, "value_mean": 0.375, "critic_version": 7.0}
    assert critic_metrics(groups[:2]) == {}


def test_values_that_do_not_line_up_are_untrainable(setup):
    _, groups = setup
    good = valued(groups[:1], 0.5)[0]
    assert good.critic is not None
    short = good.critic.model_copy(update={"values": (WireTensor.from_values([0.0], "float32"),) * 4})
    assert "critic log-probs for" in (untrainable(good.model_copy(update={"critic": short}), 259) or "")
    nan = good.critic.model_copy(
        update={"values": tuple(WireTensor.from_values([math.nan] * v.numel, "float32") for v in good.critic.values)}
    )
    assert "not finite" in (untrainable(good.model_copy(update={"critic": nan}), 259) or "")


# ---- the config -------------------------------------------------------------------------------------------------


def test_the_critic_is_the_last_role_before_the_trainer():
    chain = {r.name: r for r in config().chain}
    assert (chain["reward"].output, chain["critic"].input, chain["critic"].output) == ("scored", "scored", "train")
    with_kl = {r.name: r for r in config(trainer={"advantage": "gae", "kl": {"coef": 0.01}}).chain}
    assert with_kl["reference"].output == "critique" and with_kl["critic"].input == "critique"
    assert "critic" not in {r.name for r in parse_config({"run": "plain"}).chain}


@pytest.mark.parametrize(
    ("more", "said"),
    [
        ({"trainer": {"advantage": "grpo"}}, "a critic section needs trainer.advantage gae"),
        ({"critic": None}, "trainer.advantage gae needs a critic section"),
        ({"teacher": {"source": "tiny:64x2"}}, "a critic does not go with a teacher"),
        ({"trainer": {"advantage": "gae", "overlong": {"max_tokens": 5, "window": 2}}}, "trainer.overlong"),
    ],
)
def test_unsupported_combinations_are_refused_in_one_line(more, said):
    with pytest.raises(ConfigError, match=said):
        config(**more)

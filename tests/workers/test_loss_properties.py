"""Relations between the losses, corrections and estimators, checked on random tensors with fixed seeds."""

from __future__ import annotations

import math

import pytest
import torch

from workers.training.advantages import group_advantages
from workers.training.corrections import CORRECTIONS
from workers.training.losses import AGGREGATIONS, normalizer_of
from workers.training.policy_losses import POLICY_LOSSES, LossSettings, policy_loss

pytestmark = pytest.mark.workers

SEEDS = [0, 1, 2]


def random_case(seed: int, b: int = 6, t: int = 7, spread: float = 0.5, positive: bool = False):
    """logp (leaf with grad), logp_old, logp_rollout, advantages [B], mask with 1..T valid tokens per row."""
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = (logp_old + torch.randn(b, t, generator=g, dtype=torch.float64) * spread).requires_grad_(True)
    logp_rollout = logp_old + torch.randn(b, t, generator=g, dtype=torch.float64) * spread
    advantages = torch.randn(b, generator=g, dtype=torch.float64)
    if positive:
        advantages = advantages.abs() + 0.1
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    return logp, logp_old, logp_rollout, advantages, mask


def loss_and_grad(
    logp: torch.Tensor, *args, normalizer: float | None = None, **settings
) -> tuple[float, torch.Tensor, dict[str, float]]:
    """The loss, its gradient and metrics; `settings`: the fields of LossSettings."""
    leaf = logp.detach().clone().requires_grad_(True)
    loss, metrics = policy_loss(leaf, *args, LossSettings(**settings), normalizer)
    loss.backward()
    assert leaf.grad is not None
    return loss.item(), leaf.grad, metrics


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_with_one_token_per_sequence_is_ppo(seed, aggregation):
    logp, logp_old, logp_rollout, advantages, _ = random_case(seed, spread=1.0)
    g = torch.Generator().manual_seed(seed + 100)
    mask = torch.zeros_like(logp_old)
    mask[torch.arange(mask.shape[0]), torch.randint(0, mask.shape[1], (mask.shape[0],), generator=g)] = 1.0
    args = (logp_old, logp_rollout, advantages, mask)
    ppo = loss_and_grad(logp, *args, aggregation=aggregation)
    gspo = loss_and_grad(logp, *args, aggregation=aggregation, loss="gspo")
    assert gspo[0] == pytest.approx(ppo[0], abs=1e-12)
    assert torch.allclose(gspo[1], ppo[1], atol=1e-12)
    assert gspo[2] == pytest.approx(ppo[2], abs=1e-12)
    assert ppo[2]["ppo_clip_frac"] > 0  # the clip is exercised, not only the identity


@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_without_active_clips_is_the_ratio_weighted_policy_gradient(seed):
    # log ratios within +-0.1: r in [0.905, 1.105], inside [0.8, 1.28]
    logp, logp_old, logp_rollout, advantages, mask = random_case(seed, spread=0.05)
    with torch.no_grad():
        logp.copy_(logp_old + (logp - logp_old).clamp(-0.1, 0.1))
    args = (logp_old, logp_rollout, advantages, mask)
    _, cispo, metrics = loss_and_grad(logp, *args, loss="cispo")
    assert metrics["ppo_clip_frac"] == 0.0
    # the vanilla policy gradient: d/dlogp of -w sg(r) A logp, token-averaged
    w = CORRECTIONS["tis"](logp_old, logp_rollout, mask)[0]
    leaf = logp.detach().clone().requires_grad_(True)
    ratio = (leaf.detach() - logp_old).exp()
    (-(w * ratio * advantages.unsqueeze(1) * leaf * mask).sum() / mask.sum()).backward()
    assert torch.allclose(cispo, leaf.grad, atol=1e-12)
    # and with no clip active, that is also ppo's gradient
    _, ppo, _ = loss_and_grad(logp, *args)
    assert torch.allclose(cispo, ppo, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_dual_clip_with_positive_advantages_is_ppo(seed):
    logp, logp_old, logp_rollout, advantages, mask = random_case(seed, spread=1.5, positive=True)
    args = (logp_old, logp_rollout, advantages, mask)
    ppo = loss_and_grad(logp, *args)
    dual = loss_and_grad(logp, *args, loss="dual_clip", loss_options={"c": 1.5})
    assert dual[0] == pytest.approx(ppo[0], abs=1e-12)
    assert torch.allclose(dual[1], ppo[1], atol=1e-12)
    assert dual[2] == ppo[2]
    assert ppo[2]["ppo_clip_frac"] > 0


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_is_n_over_n_minus_1_times_centred_rewards(seed, n):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(10, n, generator=g, dtype=torch.float64)
    rewards[3] = 0.7  # a flat group: exact zeros in both
    rloo = group_advantages(rewards, "rloo")
    assert torch.allclose(rloo, n / (n - 1) * group_advantages(rewards, "drgrpo"), atol=1e-12)
    # and by its definition: r_i minus the mean of the others
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
    assert torch.allclose(rloo, rewards - others, atol=1e-12)
    assert rloo[3].tolist() == [0.0] * n


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("seed", SEEDS)
def test_no_correction_is_tis_with_bounds_zero_to_infinity_when_rollout_is_old(seed, name):
    # tis on [0, inf) truncates nothing: it is the plain IS weight exp(logp_old - logp_rollout), which is 1,
    # as `none` is, exactly when the rollout engine's log-probs are the trainer's old ones
    logp, logp_old, logp_rollout, advantages, mask = random_case(seed, spread=1.0)
    unbounded = {"correction": "tis", "correction_options": {"low": 0.0, "high": math.inf}}
    on_policy = (logp_old, logp_old.clone(), advantages, mask)
    tis = loss_and_grad(logp, *on_policy, loss=name, **unbounded)
    none = loss_and_grad(logp, *on_policy, loss=name, correction="none")
    assert none[0] == pytest.approx(tis[0], abs=1e-12)
    assert torch.allclose(none[1], tis[1], atol=1e-12)
    assert none[2] == pytest.approx(tis[2], abs=1e-12)
    # off-policy, tis on [0, inf) weighs each token by its raw IS weight and `none` by 1
    w, metrics = CORRECTIONS["tis"](logp_old, logp_rollout, mask, low=0.0, high=math.inf)
    assert torch.allclose(w, (logp_old - logp_rollout).exp() * mask, atol=1e-12)
    assert metrics["tis_clip_frac"] == 0.0
    off = (logp_old, logp_rollout, advantages, mask)
    assert loss_and_grad(logp, *off, loss=name, **unbounded)[0] != pytest.approx(
        loss_and_grad(logp, *off, loss=name, correction="none")[0], abs=1e-6
    )


@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_with_the_normalizer_sum_to_the_whole(aggregation, name, correction):
    logp, logp_old, logp_rollout, advantages, mask = random_case(7, b=8, spread=0.8)
    kwargs = {"aggregation": aggregation, "loss": name, "correction": correction}
    whole, whole_grad, _ = loss_and_grad(logp, logp_old, logp_rollout, advantages, mask, **kwargs)
    normalizer = normalizer_of(mask, aggregation)
    parts, grads = 0.0, []
    for rows in (slice(0, 3), slice(3, 8)):
        args = (logp_old[rows], logp_rollout[rows], advantages[rows], mask[rows])
        loss, grad, _ = loss_and_grad(logp[rows], *args, normalizer=normalizer, **kwargs)
        parts += loss
        grads.append(grad)
    assert parts == pytest.approx(whole, abs=1e-12)
    assert torch.allclose(torch.cat(grads), whole_grad, atol=1e-12)

"""An episode's observation tokens in the trainer: out of the batch's mask, and of every gradient.

An episode is the policy's call, the environment's observation (appended by the rollout, never trained) and the
policy's answer. The trainer's loss (`PolicyTrainer._loss`: the policy loss reweighted by the off-policy
correction, plus the KL term) must give those positions no gradient at all: whatever their rollout log-probs, their
reference log-probs or the token their log-prob scores, every parameter's gradient is the same, to the bit. The same
changes at a policy position do change the gradients, so the tests can fail.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from schemas import EpisodeInfo, PromptGroup, RolloutGroup, Sample, ScoredGroup, TextPart, TrainGroup, WireTensor
from workers.config import parse_config
from workers.data.models import load_tokenizer, materialize
from workers.data.prompts import prompt_ids
from workers.training.advantages import group_advantages
from workers.training.batch import Batch, make_batch
from workers.training.logprobs import token_logprobs
from workers.training.losses import normalizer_of
from workers.training.trainer import PolicyTrainer

pytestmark = pytest.mark.workers

PROMPT = "12+30="
EPISODES = (
    (("<call>12+30</call>", 1), ("<obs>42</obs>", 0), ("42", 1)),  # rewarded
    (("<call>12+31</call>", 1), ("<obs>43</obs>", 0), ("43", 1)),
)
CONFIGS = {
    "ppo-icepop-token": {},
    "kl-tis-sequence": {"kl": {"coef": 0.1}, "correction": {"type": "tis"}, "aggregation": "sequence"},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> Path:
    return materialize("tiny:64x2", tmp_path_factory.mktemp("models") / "tiny", seed=4)


def trainer_of(model_dir: Path, trainer: dict | None = None) -> PolicyTrainer:
    config = parse_config(
        {
            "run": "t",
            "groups_per_step": 1,
            "samples_per_group": 2,
            "rollout": {"temperature": 1.0},
            "trainer": {"optim": {"lr": 1e-2, "grad_clip": 100.0}, **(trainer or {})},
        }
    )
    return PolicyTrainer(model_dir, config)


def episode_ids(tokenizer, segments: tuple[tuple[str, int], ...]) -> tuple[list[int], list[int]]:
    """An episode's ids, segment by segment as the rollout appends them, then eos; and its loss mask."""
    ids, trained = [], []
    for text, train in segments:
        part = tokenizer.encode(text, add_special_tokens=False)
        ids += part
        trained += [train] * len(part)
    return [*ids, tokenizer.eos_token_id], [*trained, 1]


def episode_group(model: nn.Module, tokenizer, observed: float | None = None, nudge: int | None = None) -> TrainGroup:
    """The two episodes as one train group (rewards 1, 0), their rollout and reference log-probs teacher-forced
    under `model`, on observation tokens too unless `observed` replaces those (as the rollout sends them, 0). With
    the forced values an observation token that leaked into the loss would count fully (an importance weight of 1).
    `nudge` lowers the rollout log-prob of that policy token of the first episode by 0.3."""
    prompt = prompt_ids(tokenizer, PROMPT)
    samples, refs = [], []
    for segments in EPISODES:
        ids, trained = episode_ids(tokenizer, segments)
        seq = torch.tensor([prompt + ids])
        with torch.no_grad():
            forced = token_logprobs(model, seq, torch.ones_like(seq))[0, len(prompt) - 1 :].tolist()
        lps = [lp if t or observed is None else observed for lp, t in zip(forced, trained, strict=True)]
        refs.append(WireTensor.from_values(lps, "float32"))
        if nudge is not None and not samples:
            assert trained[nudge] == 1
            lps[nudge] -= 0.3
        samples.append(
            Sample(
                token_ids=WireTensor.from_values(ids, "int32"),
                logprobs=WireTensor.from_values(lps, "float32"),
                loss_mask=WireTensor.from_values(trained, "uint8"),
                episode=EpisodeInfo(turns=2, tool_calls=1, ended="answer", answer=segments[-1][0]),
            )
        )
    group = PromptGroup(
        run="t", group_id="g0", parts=(TextPart(text=PROMPT),), n_samples=2, release_index=0, released_at_version=0
    )
    rollout = RolloutGroup(
        prompt=group,
        prompt_token_ids=WireTensor.from_values(prompt, "int32"),
        samples=tuple(samples),
        policy_version=0,
    )
    return TrainGroup(scored=ScoredGroup(rollout=rollout, rewards=(1.0, 0.0)), ref_logprobs=tuple(refs))


class Pinned(nn.Module):
    """A model that reads `context` whatever ids it is given, so `token_logprobs(pinned, targets, ...)` scores the
    tokens of `targets` after the context of `context`: a target changed without changing what the model saw."""

    def __init__(self, model: nn.Module, context: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.context = context

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> object:  # the ids only choose the targets
        return self.model(input_ids=self.context, **kwargs)


def gradients(trainer: PolicyTrainer, batch: Batch, targets: torch.Tensor | None = None):
    """The gradient of the trainer's loss on `batch` (one update: logp_old = logp) w.r.t. its token log-probs
    [N, T-1] and every parameter. The log-probs come from the trainer's own forward, or, with `targets`, from
    `token_logprobs` scoring `targets` after the batch's ids."""
    rows = list(range(batch.ids.shape[0]))
    trainer.optimizer.zero_grad(set_to_none=True)
    if targets is None:
        mb, logp = trainer.forward.logprobs(batch, rows)
    else:
        mb = batch.rows(rows, trainer.device)
        logp = token_logprobs(Pinned(trainer.model, mb.ids), targets, mb.attention, trainer.config.rollout.temperature)
    logp.retain_grad()
    est = trainer.cfg.advantage
    adv = group_advantages(batch.rewards, est.type, est.eps, est.whiten).reshape(-1)
    loss, _ = trainer._loss(mb, logp, logp.detach(), adv, normalizer_of(mb.mask, trainer.cfg.aggregation))
    loss.backward()
    return logp.grad.clone(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def positions(group: TrainGroup, row: int, trained: int) -> list[int]:
    """The log-prob positions (columns of a batch's mask) of sample `row`'s tokens whose loss mask is `trained`,
    read from the sample itself (position t scores token t + 1)."""
    start = group.scored.rollout.prompt_token_ids.numel - 1
    return [start + i for i, t in enumerate(group.scored.rollout.samples[row].trained()) if t == trained]


def test_make_batch_puts_zeros_on_the_observation_positions_of_the_mask(model_dir):
    tok = load_tokenizer(model_dir)
    model = trainer_of(model_dir).model
    episodes = episode_group(model, tok, observed=0.0)
    plain = episodes.scored.rollout.samples[0].model_copy(update={"loss_mask": None, "episode": None})
    one_turn = TrainGroup(
        scored=ScoredGroup(
            rollout=episodes.scored.rollout.model_copy(update={"samples": (plain, plain)}), rewards=(1.0, 0.0)
        ),
        ref_logprobs=episodes.ref_logprobs,
    )
    batch = make_batch([episodes, one_turn])
    prompt = prompt_ids(tok, PROMPT)
    p = len(prompt)
    for row, sample in enumerate([*episodes.scored.rollout.samples, plain, plain]):
        ids, r = sample.token_ids.to_values(), sample.token_ids.numel
        assert batch.ids[row, : p + r].tolist() == prompt + ids
        expected = torch.zeros(batch.mask.shape[1])
        expected[p - 1 : p - 1 + r] = torch.tensor(sample.trained(), dtype=torch.float32)
        assert torch.equal(batch.mask[row], expected)
        assert batch.rollout_logp[row, p - 1 : p - 1 + r].tolist() == sample.logprobs.to_values()
    first = episodes.scored.rollout.samples[0].trained()
    observation = tok.encode("<obs>42</obs>", add_special_tokens=False)
    start = first.index(0)
    assert first[start : start + len(observation)] == [0] * len(observation) and sum(first) == len(first) - len(
        observation
    )
    assert batch.ids[0, p + start : p + start + len(observation)].tolist() == observation
    assert batch.mask[2, p - 1 : p - 1 + len(first)].tolist() == [1.0] * len(first)  # no loss mask: all trained


@pytest.mark.parametrize("settings", list(CONFIGS.values()), ids=list(CONFIGS))
def test_observation_positions_get_exactly_zero_gradient(model_dir, settings):
    trainer = trainer_of(model_dir, settings)
    group = episode_group(trainer.model, trainer.tokenizer)
    batch = make_batch([group])
    logp_grad, base = gradients(trainer, batch)
    for row in range(2):
        observed, policy = positions(group, row, 0), positions(group, row, 1)
        assert len(observed) == len("<obs>42</obs>") and len(policy) > len(observed)
        assert torch.equal(logp_grad[row, observed], torch.zeros(len(observed)))
        assert bool((logp_grad[row, policy] != 0).all())
    assert base and any(bool(g.abs().sum() > 0) for g in base.values())
    # Rollout and reference log-probs at observation positions mean nothing: any value gives the same gradients.
    obs = torch.zeros_like(batch.mask, dtype=torch.bool)
    for row in range(2):
        obs[row, positions(group, row, 0)] = True
    for value in (-1e4, 0.0, 30.0):
        changed = dataclasses.replace(
            batch,
            rollout_logp=batch.rollout_logp.masked_fill(obs, value),
            ref_logp=batch.ref_logp.masked_fill(obs, value),
        )
        assert same(gradients(trainer, changed)[1], base), value
    # ... while a policy position's rollout log-prob (the correction's weight) does change them.
    policy_at = positions(group, 0, 1)[-2]
    nudged = batch.rollout_logp.clone()
    nudged[0, policy_at] -= 0.3
    assert not same(gradients(trainer, dataclasses.replace(batch, rollout_logp=nudged))[1], base)


@pytest.mark.parametrize("settings", list(CONFIGS.values()), ids=list(CONFIGS))
def test_the_token_an_observation_position_scores_changes_no_gradient(model_dir, settings):
    trainer = trainer_of(model_dir, settings)
    group = episode_group(trainer.model, trainer.tokenizer)
    batch = make_batch([group])
    _, base = gradients(trainer, batch, targets=batch.ids)
    assert same(gradients(trainer, batch, targets=batch.ids)[1], base)  # the pinned forward is deterministic
    vocab = trainer.vocab_size
    observed = positions(group, 0, 0)
    assert len(observed) == len("<obs>42</obs>")
    for at in observed:
        targets = batch.ids.clone()
        targets[0, at + 1] = (targets[0, at + 1] + 7) % vocab
        assert same(gradients(trainer, batch, targets=targets)[1], base), at
    targets = batch.ids.clone()
    at = positions(group, 0, 1)[-2]
    targets[0, at + 1] = (targets[0, at + 1] + 7) % vocab
    assert not same(gradients(trainer, batch, targets=targets)[1], base)


def test_a_trainer_step_ignores_the_rollout_logprobs_of_observation_tokens(model_dir):
    """Whole steps from the same start: observation log-probs as the rollout sends them (0), as the model gives them
    (an importance weight of 1, were they in the loss) or -1e4 give the same weights, bit for bit; one policy token's
    rollout log-prob moved by 0.3 gives other weights."""
    stepped = []
    for observed, nudge in ((0.0, None), (None, None), (-1e4, None), (0.0, 5)):
        trainer = trainer_of(model_dir)
        group = episode_group(trainer.model, trainer.tokenizer, observed=observed, nudge=nudge)
        assert trainer.untrainable(group) is None
        metrics = trainer.step([group])
        assert metrics["grad_norm"] > 0
        stepped.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
    zero, forced, garbage, nudged = stepped
    assert same(zero, forced) and same(zero, garbage)
    assert not same(zero, nudged)

"""A trainer step's metrics: summed over the micro-batches of each update (and over ranks), averaged over the
step's updates.

    loss, kl          summed over micro-batches: each is already that micro-batch's share of the mini-batch's loss
    batch ones        the step's rewards (before shaping) and response tokens (after masking)
    per-token ones    weighted by each micro-batch's valid tokens, divided by the mini-batch's (all ranks); the
                      optional ones (`distill_reverse_kl`, a run with a teacher) only where the loss reports them
    largest ones      maxima over micro-batches, ranks and the step's updates (`tis_max`)
    summed ones       seconds of the step's updates, summed over them (`sft_s`)

The actor adds what the trained groups themselves say (`reward_metrics`, `response_metrics`, `episode_metrics`) and
the namespaced names (`policy_aliases`), in the `reward/`, `response/` and `policy/` sections TRL and veRL users read.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from schemas import Sample, TrainGroup
from schemas.bounded import name_part
from workers.training.batch import Batch
from workers.training.corrections import CORRECTION_METRICS
from workers.training.policy_losses import LOSS_METRICS
from workers.training.ranks import OneProcess

LARGEST = ("tis_max",)
SUMMED = ("sft_s",)
TOKEN_METRICS = tuple(n for n in (*LOSS_METRICS, *CORRECTION_METRICS) if n not in LARGEST)
OPTIONAL_TOKEN_METRICS = ("distill_reverse_kl", "gae_advantage_mean")
"""Per-token metrics of a term only some runs have (the same on every rank of a run)."""
MAX_REWARD_TERMS = 32
"""Most reward terms a step reports (`reward/<term>/mean`), the first in name order: a metric's values are bounded."""


class UpdateSums:
    """One update's metrics, accumulated over its micro-batches."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)

    def add(self, loss: torch.Tensor, metrics: dict[str, float], tokens: float) -> None:
        """A micro-batch's loss and metrics (`kl` when a KL term is on); `tokens`: its valid tokens."""
        s = self.sums
        s["kl"] += metrics.get("kl", 0.0)
        s["loss"] += float(loss.detach())
        for name in TOKEN_METRICS:
            s[name] += metrics[name] * tokens
        for name in OPTIONAL_TOKEN_METRICS:
            if name in metrics:
                s[name] += metrics[name] * tokens
        for name in LARGEST:
            s[name] = max(s[name], metrics[name])

    def reduced(self, ranks: OneProcess, tokens: float) -> dict[str, float]:
        """The update's metrics over every rank; `tokens`: the mini-batch's valid tokens on all ranks."""
        per_token = [*TOKEN_METRICS, *(n for n in OPTIONAL_TOKEN_METRICS if n in self.sums)]
        names = ["loss", "kl", *per_token]
        values = ranks.sum([self.sums[n] for n in names])
        largest = ranks.max([self.sums[n] for n in LARGEST])
        out = dict(zip([*names, *LARGEST], [*values, *largest], strict=True))
        for name in per_token:
            out[name] /= max(tokens, 1.0)
        return out


class StepSums:
    """The step's metrics over its updates: means, and maxima for the largest ones."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.largest: dict[str, float] = defaultdict(float)

    def add(self, update: dict[str, float]) -> None:
        for name, value in update.items():
            if name in LARGEST:
                self.largest[name] = max(self.largest[name], value)
            else:
                self.totals[name] += value

    def means(self, updates: int) -> dict[str, float]:
        """The step's metrics: means over its `updates`, maxima for the largest ones, sums for the summed ones."""
        return {
            **{name: value if name in SUMMED else value / updates for name, value in self.totals.items()},
            **self.largest,
        }


def batch_metrics(batch: Batch) -> dict[str, float]:
    """The step's rewards (mean, population std over the samples that have one; before shaping), response tokens
    and samples left out for want of a reward (`samples_excluded`)."""
    rewards = batch.rewards if batch.valid is None else batch.rewards[batch.valid]
    return {
        "reward_mean": float(rewards.mean()) if rewards.numel() else float("nan"),
        "reward_std": float(rewards.std(unbiased=False)) if rewards.numel() else float("nan"),
        "response_tokens": float(batch.mask.sum()),
        "samples_excluded": 0.0 if batch.valid is None else float((~batch.valid).sum()),
    }


def episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """A step's agentic episodes (samples with `episode`): turns and tool calls per episode, the fraction of calls the
    environment took as valid, environment errors, replays and resumed turns (counts), seconds waited for the
    environment per call, the truncated fraction and the mean environment reward; empty without episodes."""
    episodes = [s.episode for s in samples if s.episode is not None]
    if not episodes:
        return {}
    count = len(episodes)
    calls = sum(e.tool_calls for e in episodes)
    rewarded = [e.env_reward for e in episodes if e.env_reward is not None]
    return {
        "episode_turns_mean": sum(e.turns for e in episodes) / count,
        "episode_tool_calls_mean": calls / count,
        "tool_call_valid_fraction": (calls - sum(e.invalid_calls for e in episodes)) / calls if calls else float("nan"),
        "episode_truncated_fraction": sum(e.truncated for e in episodes) / count,
        "episode_answered_fraction": sum(e.ended == "answer" for e in episodes) / count,
        "env_errors": float(sum(e.env_errors for e in episodes)),
        "env_replays": float(sum(e.replays for e in episodes)),
        "episode_resumed_turns": float(sum(e.resumed_turns for e in episodes)),
        "env_s_per_call": sum(e.env_s for e in episodes) / calls if calls else 0.0,
        "env_reward_mean": sum(rewarded) / len(rewarded) if rewarded else float("nan"),
    }


def critic_metrics(groups: Sequence[TrainGroup]) -> dict[str, float]:
    """The critic's figures over the step's groups (a run with a critic; empty otherwise), means over the groups of
    each group's own: `value_loss` (the critic's clipped value loss on the group before its update on it) and
    `value_mean`; and `critic_version` (the newest critic version among them). The step's `explained_variance` is
    the trainer's, over the whole batch's tokens (a group's own is noisy: its returns barely vary)."""
    stats = [g.critic for g in groups if g.critic is not None]
    if not stats:
        return {}
    n = len(stats)
    return {
        "value_loss": sum(c.value_loss for c in stats) / n,
        "value_mean": sum(c.value_mean for c in stats) / n,
        "critic_version": float(max(c.version for c in stats)),
    }


def reward_metrics(groups: Sequence[TrainGroup]) -> dict[str, float]:
    """The step's reward terms and failures, from each sample's `RewardDetail` (empty without groups):

        reward/<term>/mean   mean over the samples with a reward and a detail of the term's weighted value, as it
                             enters the reward (0 for a sample without that term); with a detail for every sample
                             the terms sum to `reward_mean`
        reward/error_rate    samples whose reward failed (left out of the update, `samples_excluded`) / all samples

    <term> is the component's name (`scorer.Score.components`: a reward's `name`, or `name.key` for each key of a
    function that returns a dict) as a metric name segment (`schemas.bounded.name_part`; components whose names
    become one are added together); at most `MAX_REWARD_TERMS` terms, the first in name order."""
    details = [d for g in groups for d in g.scored.details or () if d.error is None]
    samples = sum(len(g.scored.rollout.samples) for g in groups)
    if not samples:
        return {}
    failed = sum(d.error is not None for g in groups for d in g.scored.details or ())
    sums: dict[str, float] = defaultdict(float)
    for detail in details:
        for name, value in _by_name(detail.components).items():
            sums[name] += value
    terms = sorted(sums)[:MAX_REWARD_TERMS]
    return {
        **{f"reward/{term}/mean": sums[term] / len(details) for term in terms},
        "reward/error_rate": failed / samples,
    }


def reward_terms(components: dict[str, float]) -> dict[str, float]:
    """One sample's reward components under the names `reward_metrics` reports them by (components whose names
    become one added together), at most `MAX_REWARD_TERMS`, the first in name order."""
    terms = _by_name(components)
    return {name: terms[name] for name in sorted(terms)[:MAX_REWARD_TERMS]}


def _by_name(components: dict[str, float]) -> dict[str, float]:
    """The components by their metric name segment (`name_part`), those whose names become one added together."""
    out: dict[str, float] = defaultdict(float)
    for name, value in components.items():
        out[name_part(name)] += value
    return out


def response_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """The step's responses, every sample (a failed reward's too; empty without samples):

    response/length_mean, response/length_max   response tokens (an episode's: all its turns, observations too)
    response/truncated_fraction                 samples cut by a limit: finish_reason `length`, or an episode
                                                ended by `agent.max_tokens` / `agent.max_turns`"""
    if not samples:
        return {}
    lengths = [s.token_ids.numel for s in samples]
    truncated = sum(s.finish_reason == "length" or (s.episode is not None and s.episode.truncated) for s in samples)
    return {
        "response/length_mean": sum(lengths) / len(lengths),
        "response/length_max": float(max(lengths)),
        "response/truncated_fraction": truncated / len(samples),
    }


POLICY_ALIASES = {"policy/clip_fraction": "ppo_clip_frac"}
"""Namespaced names of existing metrics (the existing name stays): alias -> name."""


def policy_aliases(metrics: dict[str, float]) -> dict[str, float]:
    """The namespaced copies (`POLICY_ALIASES`) of the trainer's metrics that are there."""
    return {alias: metrics[name] for alias, name in POLICY_ALIASES.items() if name in metrics}

"""Small builders of valid messages for tests."""

from __future__ import annotations

from schemas import (
    PromptGroup,
    RewardDetail,
    RolloutGroup,
    Sample,
    ScoredGroup,
    TextPart,
    TrainGroup,
    WireTensor,
)
from workers.data.tokenizer import EOS_ID


def prompt(run: str, i: int = 0, attempt: int = 0, text: str | None = None, n: int = 2) -> PromptGroup:
    return PromptGroup(
        run=run,
        group_id=f"g{i}",
        parts=(TextPart(text=text if text is not None else f"{i}+1="),),
        answer=str(i + 1),
        n_samples=n,
        attempt=attempt,
        release_index=i,
        released_at_version=0,
        index=i,
    )


def said(text: str) -> Sample:
    """A sample whose token ids are `text` in the byte tokenizer, then eos: the text they decode to is `text`."""
    ids = [*text.encode(), EOS_ID]
    return Sample(
        token_ids=WireTensor.from_values(ids, "int32"),
        logprobs=WireTensor.from_values([-0.5] * (len(ids) - 1) + [-0.1], "float32"),
        text=text,
    )


def rollout(p: PromptGroup, version: int = 0) -> RolloutGroup:
    samples = tuple(said(str(k)) for k in range(p.n_samples))
    return RolloutGroup(
        prompt=p,
        prompt_token_ids=WireTensor.from_values([1, 2, 3], "int32"),
        samples=samples,
        policy_version=version,
        worker_id="test",
    )


def routed(r: RolloutGroup, layers: int = 2, k: int = 2) -> RolloutGroup:
    """`r` with routed experts on every sample (R3): uint8 [prompt + tokens - 1, layers, k]."""
    prompt = r.prompt_token_ids.numel
    samples = []
    for s in r.samples:
        fed = prompt + s.token_ids.numel - 1
        ids = WireTensor.from_values([i % 8 for i in range(fed * layers * k)], "uint8", (fed, layers, k))
        samples.append(s.model_copy(update={"routed_experts": ids}))
    return RolloutGroup(**{**dict(r), "samples": tuple(samples)})


def scored(r: RolloutGroup) -> ScoredGroup:
    n = len(r.samples)
    return ScoredGroup(rollout=r, rewards=(1.0,) * n, details=(RewardDetail(components={"exact": 1.0}),) * n)


def train(run: str, i: int = 0, version: int = 0, attempt: int = 0) -> TrainGroup:
    return TrainGroup(scored=scored(rollout(prompt(run, i, attempt), version)))

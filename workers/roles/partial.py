"""Partial rollouts: generation in chunks, with a newer policy version taken between chunks (`rollout.partial`).

Every row (prompt i, sample j) is generated `rollout.partial_chunk` tokens at a time. A continuation is a new
engine request whose prompt is the original prompt plus the row's tokens so far, so every engine serves it
(torch and vLLM alike: nothing engine-specific is kept between chunks). Between chunks the rollout worker loads
the newest published weights when there are any:

    continue   the rows keep their tokens and go on under the new weights: a response's tokens may come from
               several versions, recorded run-length per sample (`Sample.version_spans`)
    restart    the rows drop their tokens and the group starts over under the new weights, once per call; after
               that it continues as above, so a stream of new versions cannot starve a group

A token is labelled with `engine.version`, which only a completed weight load moves: a version whose fetch or load
failed never labels a token (the rows go on under the weights they had). The group's `policy_version` is its
oldest token's version, which the staleness rule judges (`relax_bus.staleness`).

Row j of prompt i draws chunk c from the random stream `seeds[i] + j + c * CHUNK_STRIDE`: with one chunk it is the
stream a plain call gives that row, so `partial` with a chunk of at least `max_new_tokens` samples what `off` does
(up to the engine's rounding between batch shapes).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from workers.engines.base import Engine, Generated, SamplingSettings

CHUNK_STRIDE = 1_000_003
SEED_MOD = 1 << 31


@dataclass
class _Row:
    prompt: list[int]
    seed: int | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish: Literal["stop", "length"] = "length"
    done: bool = False

    def reset(self) -> None:
        self.tokens, self.logprobs, self.versions, self.texts, self.finish, self.done = [], [], [], [], "length", False


@dataclass(frozen=True)
class Partial:
    """A completion generated in chunks: the completion and the version of each of its tokens."""

    generated: Generated
    versions: list[int]

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """`versions` run-length encoded: ((version, count), ...) in token order."""
        return spans_of(self.versions)


def labelled(samples: list[Partial]) -> tuple[int, list[tuple[tuple[int, int], ...]]]:
    """A group's version (its oldest token's) and each sample's version spans as the wire carries them: empty for
    a sample whose every token is of the group's version, explicit otherwise (a restarted group may be wholly of
    a newer version than the call started with: then that newer version is the group's)."""
    version = min(v for p in samples for v in p.versions)
    return version, [() if set(p.versions) == {version} else p.spans for p in samples]


def spans_of(versions: list[int]) -> tuple[tuple[int, int], ...]:
    """Run-length encoding of per-token versions: [3, 3, 4] -> ((3, 2), (4, 1))."""
    out: list[tuple[int, int]] = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return tuple(out)


async def generate_partial(
    engine: Engine,
    prompts: list[list[int]],
    n: int,
    sampling: SamplingSettings,
    seeds: list[int] | None,
    chunk: int,
    mode: Literal["continue", "restart"],
    refresh: Callable[[], Awaitable[bool]],
) -> list[list[Partial]]:
    """Sample n completions per prompt, `chunk` tokens at a time; `refresh()` loads the newest weights between
    chunks and says whether it did. One inner list per prompt, as `Engine.generate`."""
    rows = [
        _Row(prompt=list(p), seed=None if seeds is None else seeds[i] + j)
        for i, p in enumerate(prompts)
        for j in range(n)
    ]
    restarted = False
    chunks = 0
    while pending := [r for r in rows if not r.done]:
        step = min(chunk, sampling.max_new_tokens - max(len(r.tokens) for r in pending))
        settings = dataclasses.replace(sampling, max_new_tokens=step, seed=None)
        row_seeds = None if seeds is None else [((r.seed or 0) + chunks * CHUNK_STRIDE) % SEED_MOD for r in pending]
        outputs = await asyncio.to_thread(
            engine.generate, [r.prompt + r.tokens for r in pending], 1, settings, row_seeds
        )
        version = engine.version
        for r, (out,) in zip(pending, outputs, strict=True):
            r.tokens += out.token_ids
            r.logprobs += out.logprobs
            r.versions += [version] * len(out.token_ids)
            r.texts.append(out.text)
            r.finish = out.finish_reason
            # a row that stopped, reached its length, or got fewer tokens than asked (the engine's context) is done
            r.done = (
                out.finish_reason == "stop" or len(out.token_ids) < step or len(r.tokens) >= sampling.max_new_tokens
            )
        chunks += 1
        if all(r.done for r in rows) or not await refresh():
            continue
        if mode == "restart" and not restarted:  # the whole group again, under the new weights
            restarted, chunks = True, 0
            for r in rows:
                r.reset()
    tokenizer = getattr(engine, "tokenizer", None)  # decoding the whole response keeps characters split by a chunk
    out: list[list[Partial]] = [[] for _ in prompts]
    for index, r in enumerate(rows):
        text = "".join(r.texts) if tokenizer is None else str(tokenizer.decode(r.tokens, skip_special_tokens=True))
        completion = Generated(token_ids=r.tokens, logprobs=r.logprobs, text=text, finish_reason=r.finish)
        out[index // n].append(Partial(completion, r.versions))
    return out

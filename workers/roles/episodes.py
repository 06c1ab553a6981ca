"""Multi-turn episodes: the rollout role's loop over policy turns and environment steps (`agent` in the run config).

Every sample of a group is one episode. The episodes of an engine call advance in waves: one engine call generates
the next turn of every episode still running (its prompt is the episode's ids so far: nothing is re-rendered), then
the environment steps of every turn that called a tool run concurrently, each on the environment instance that
holds its episode. A slow environment therefore delays a wave, never one engine call per episode.

    ids        prompt, then turn 1's sampled tokens, observation 1, turn 2's tokens, ...
    trained    1 on sampled tokens, 0 on observation tokens (`Sample.loss_mask`)
    logprobs   the engine's, per sampled token (0 on observation tokens)
    versions   the engine's weights version per token; an observation takes its turn's

Weights load only between engine calls, so every turn of an episode generated in one call has one version; an
episode taken over from another worker's record keeps its recorded tokens' versions, and its group's version is
its oldest token's (the staleness rule's, as with partial rollouts).

An episode ends when a turn calls no tool (`answer`: that turn's text is the final answer), when the environment
says done (`env_done`), at `agent.max_turns` or `agent.max_tokens` (truncated, flagged), or when its environment
fails (`env_error`) or cannot be replaced (`env_lost`). After every completed turn the episode's record goes to the
bus (`record`), so another worker can resume it from there; the record of an episode that ended says why, and a
resumed episode that had ended is returned as recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast, get_args, runtime_checkable

import msgpack

from relax_bus.log import get_logger
from schemas import EpisodeInfo, Sample, WireTensor
from schemas.episode import EpisodeEnd
from workers.engines.base import Engine, SamplingSettings
from workers.engines.torch_turns import TurnBatch
from workers.envs.base import EnvItem, StepResult
from workers.envs.errors import EnvFailed, EnvLost
from workers.envs.formats import ToolFormat
from workers.roles.partial import spans_of

log = get_logger(__name__)
TURN_STRIDE = 7_919_993
"""Turn t of a row draws from the random stream `seed + t * TURN_STRIDE` (turn 0 is the row's plain stream)."""
SEED_MOD = 1 << 31
ENDS = frozenset(get_args(EpisodeEnd))


@runtime_checkable
class TurnEngine(Protocol):
    """An engine that keeps a batch of episodes' KV cache across their turns (`TorchEngine.open_turns`)."""

    def open_turns(self, contexts: list[list[int]]) -> TurnBatch: ...


class EnvSessionLike(Protocol):
    """What the loop needs of one episode's environment session (`workers.envs.client.EnvSession`)."""

    observation: str
    replays: int

    async def step(self, action: str) -> StepResult: ...

    async def close(self) -> None: ...


Opener = Callable[[EnvItem, Sequence[str]], Awaitable[EnvSessionLike]]
"""Opens an episode's environment (reset, then the recorded actions replayed)."""
Recorder = Callable[["EpisodeRecord"], Awaitable[None]]


@dataclass(frozen=True)
class Limits:
    """An episode's bounds (from `agent`): policy turns, tokens after the prompt, tokens per turn, observation
    characters."""

    max_turns: int
    max_tokens: int
    turn_tokens: int
    max_observation_chars: int


@dataclass
class EpisodeRecord:
    """An episode so far: what is recorded on the bus after each completed turn, and what a resuming worker reads."""

    episode: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    turns: int = 0
    invalid_calls: int = 0
    env_reward: float | None = None
    env_errors: int = 0
    env_s: float = 0.0
    started: bool = False
    """The environment's first observation is in `tokens` already."""
    ended: str | None = None
    """Why the episode ended, once it has: a resuming worker returns it as it is, never samples past its end."""
    answer: str = ""
    """The final answer of an episode that ended `answer`."""

    def snapshot(self) -> EpisodeRecord:
        """A copy that the next turns leave as it is (what a put in flight encodes)."""
        return dataclasses.replace(
            self,
            tokens=list(self.tokens),
            logprobs=list(self.logprobs),
            trained=list(self.trained),
            versions=list(self.versions),
            actions=list(self.actions),
        )

    def to_bytes(self) -> bytes:
        return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> EpisodeRecord:
        """The record `to_bytes` wrote; ValueError for one that is not (the episode then starts over)."""
        fields = msgpack.unpackb(data, raw=False)
        if not isinstance(fields, dict):
            raise ValueError("an episode record is a map")
        known = {f.name for f in dataclasses.fields(cls)}
        record = cls(**{k: v for k, v in fields.items() if k in known})
        sizes = {len(record.tokens), len(record.logprobs), len(record.trained), len(record.versions)}
        if len(sizes) != 1 or len(record.actions) > record.turns:
            raise ValueError("an episode record whose tokens, log-probs, mask and versions differ in length")
        return record


@dataclass
class _Episode:
    record: EpisodeRecord
    prompt: list[int]
    item: EnvItem
    seed: int | None
    resumed_turns: int = 0
    session: EnvSessionLike | None = None
    ended: EpisodeEnd | None = None
    answer: str = ""
    fed: int = 0
    """Tokens of the record the engine's turn batch holds (the rest is appended before the next turn)."""

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None, version: int, trained: int) -> None:
        rec = self.record
        rec.tokens += list(ids)
        rec.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        rec.trained += [trained] * len(ids)
        rec.versions += [version] * len(ids)


async def run_episodes(
    engine: Engine,
    fmt: ToolFormat,
    sampling: SamplingSettings,
    limits: Limits,
    prompts: Sequence[list[int]],
    items: Sequence[EnvItem],
    seeds: Sequence[int | None],
    open_env: Opener,
    resumed: Sequence[EpisodeRecord | None] = (),
    record: Recorder | None = None,
) -> list[Sample]:
    """Run one episode per row (`prompts[i]`, `items[i]`, `seeds[i]`) to its end; one Sample per row, in order.

    `resumed[i]`, when given, is the recorded state of row i's episode, continued from its last completed turn.
    """
    rows = [
        _Episode(
            record=(resumed[i] if i < len(resumed) and resumed[i] is not None else EpisodeRecord(items[i].episode)),  # type: ignore[arg-type]
            prompt=list(prompts[i]),
            item=items[i],
            seed=seeds[i],
        )
        for i in range(len(prompts))
    ]
    for ep in rows:
        ep.resumed_turns = ep.record.turns
        if ep.record.ended in ENDS:  # recorded after its last turn: nothing is left to run
            ep.ended, ep.answer = cast(EpisodeEnd, ep.record.ended), ep.record.answer
    recording: asyncio.Future[list[None]] | None = None
    try:
        await asyncio.gather(*(_open(ep, open_env, fmt, limits, engine.version) for ep in rows if ep.ended is None))
        running = [ep for ep in rows if ep.ended is None]
        turns: TurnBatch | None = None
        if running and isinstance(engine, TurnEngine):  # one KV cache across the turns (the torch engine)
            turns = engine.open_turns([ep.prompt + ep.record.tokens for ep in running])
            for ep in running:
                ep.fed = len(ep.record.tokens)
        while running:
            await _policy_turn(engine, fmt, sampling, limits, running, turns)
            calling = [ep for ep in running if ep.ended is None]
            await asyncio.gather(*(_env_step(ep, fmt, limits) for ep in calling))
            if record is not None:  # the puts of this wave run while the next turn generates
                for ep in running:
                    ep.record.ended, ep.record.answer = ep.ended, ep.answer
                await _settled(recording)
                recording = asyncio.gather(*(record(ep.record.snapshot()) for ep in running))
            if turns is not None:
                turns.keep([i for i, ep in enumerate(running) if ep.ended is None])
            running = [ep for ep in running if ep.ended is None]
            if turns is not None:
                for i, ep in enumerate(running):
                    turns.extend(i, ep.record.tokens[ep.fed :])
                    ep.fed = len(ep.record.tokens)
        await _settled(recording)
    finally:
        if recording is not None and not recording.done():
            recording.cancel()
        await asyncio.gather(*(_close(ep) for ep in rows))
    return [_sample(ep, engine) for ep in rows]


async def _settled(recording: asyncio.Future[list[None]] | None) -> None:
    """Wait for a wave's record puts (their failure is raised here: a turn that cannot be recorded fails the call)."""
    if recording is not None:
        await recording


async def _open(ep: _Episode, open_env: Opener, fmt: ToolFormat, limits: Limits, version: int) -> None:
    """Start (or, when resumed, replay) the episode's environment; append its first observation once."""
    started = time.perf_counter()
    try:
        ep.session = await open_env(ep.item, list(ep.record.actions))
    except (EnvFailed, EnvLost) as err:
        ep.record.env_errors += 1
        ep.ended = "env_error" if isinstance(err, EnvFailed) else "env_lost"
        log.info("episode_env_failed", episode=ep.item.episode, at="reset", error=str(err))
        return
    finally:
        ep.record.env_s += time.perf_counter() - started
    if not ep.record.started:
        ep.record.started = True
        text = ep.session.observation[: limits.max_observation_chars]
        ids = fmt.opening_ids(text) if text else []
        if len(ids) > limits.max_tokens:  # as an observation after a step: not appended when it does not fit
            ep.ended = "max_tokens"
            return
        ep.add(ids, None, max(0, version), 0)


async def _policy_turn(
    engine: Engine,
    fmt: ToolFormat,
    sampling: SamplingSettings,
    limits: Limits,
    running: list[_Episode],
    turns: TurnBatch | None,
) -> None:
    """Generate the next turn of every running episode in one engine call; end those that answered or hit a bound.
    With `turns`, on the batch's KV cache; otherwise each episode's ids so far are the prompt of a new request."""
    budget = min(limits.turn_tokens, max(limits.max_tokens - len(ep.record.tokens) for ep in running))
    turn_sampling = dataclasses.replace(sampling, max_new_tokens=max(1, budget), stop=fmt.stop, seed=None)
    seeds = [None if ep.seed is None else (ep.seed + ep.record.turns * TURN_STRIDE) % SEED_MOD for ep in running]
    use_seeds = None if any(s is None for s in seeds) else [int(s) for s in seeds if s is not None]
    if turns is not None:
        generated = await asyncio.to_thread(turns.turn, turn_sampling, use_seeds)
    else:
        contexts = [ep.prompt + ep.record.tokens for ep in running]
        outputs = await asyncio.to_thread(engine.generate, contexts, 1, turn_sampling, use_seeds)
        generated = [g for (g,) in outputs]
    version = engine.version
    for ep, gen in zip(running, generated, strict=True):
        room = max(0, limits.max_tokens - len(ep.record.tokens))  # a negative bound would slice from the end
        ids, lps = gen.token_ids[:room], gen.logprobs[:room]
        ep.add(ids, lps, version, 1)
        ep.fed = len(ep.record.tokens)  # a turn batch's cache holds the sampled tokens (the last one waits in it)
        ep.record.turns += 1
        cut = len(ids) < len(gen.token_ids)
        action = None if cut else fmt.call_of(gen.text)
        if action is not None and gen.finish_reason == "stop":
            ep.record.actions.append(action)
            if ep.record.turns >= limits.max_turns:
                ep.ended = "max_turns"
        elif gen.finish_reason == "stop" and not cut:
            ep.ended, ep.answer = "answer", gen.text
        else:
            ep.ended = "max_tokens"


async def _env_step(ep: _Episode, fmt: ToolFormat, limits: Limits) -> None:
    """Send the episode's last action to its environment; append the observation (never trained)."""
    assert ep.session is not None
    rec = ep.record
    started = time.perf_counter()
    try:
        result = await ep.session.step(rec.actions[-1])
    except (EnvFailed, EnvLost) as err:
        rec.env_errors += 1
        ep.ended = "env_error" if isinstance(err, EnvFailed) else "env_lost"
        log.info("episode_env_failed", episode=ep.item.episode, turn=rec.turns, error=str(err))
        return
    finally:
        rec.env_s += time.perf_counter() - started
    if result.reward is not None:
        rec.env_reward = (rec.env_reward or 0.0) + float(result.reward)
    if result.info.get("valid") is False:
        rec.invalid_calls += 1
    ids = fmt.observation_ids(result.observation[: limits.max_observation_chars])
    if len(rec.tokens) + len(ids) > limits.max_tokens:
        ep.ended = "max_tokens"
        return
    ep.add(ids, None, rec.versions[-1], 0)
    if result.done:
        ep.ended = "env_done"


async def _close(ep: _Episode) -> None:
    if ep.session is None:
        return
    try:
        await ep.session.close()
    except Exception as err:  # tolerated: an instance's idle episodes expire on their own
        log.debug("episode_close_failed", episode=ep.item.episode, error=f"{type(err).__name__}: {err}")


def _sample(ep: _Episode, engine: Engine) -> Sample:
    rec = ep.record
    assert ep.ended is not None
    tokenizer: Any = getattr(engine, "tokenizer", None)
    text = str(tokenizer.decode(rec.tokens, skip_special_tokens=True)) if tokenizer is not None else ""
    info = EpisodeInfo(
        turns=rec.turns,
        tool_calls=len(rec.actions),
        invalid_calls=rec.invalid_calls,
        ended=ep.ended,
        answer=ep.answer,
        env_reward=rec.env_reward,
        env_errors=rec.env_errors,
        replays=ep.session.replays if ep.session is not None else 0,
        resumed_turns=ep.resumed_turns,
        env_s=rec.env_s,
    )
    return Sample(
        token_ids=WireTensor.from_values(rec.tokens, "int32"),
        logprobs=WireTensor.from_values(rec.logprobs, "float32"),
        text=text,
        finish_reason="stop" if ep.ended in ("answer", "env_done") else "length",
        version_spans=spans_of(rec.versions),
        loss_mask=WireTensor.from_values(rec.trained, "uint8"),
        episode=info,
    )


def group_version(samples: Sequence[Sample], current: int) -> tuple[int, list[Sample]]:
    """A group of episodes' version (its oldest token's; `current` for a group without tokens) and its samples with
    the version spans the wire carries: empty for a sample whose every token is of the group's version."""
    versions = [v for s in samples for v, _ in s.version_spans]
    oldest = min(versions, default=current)
    return oldest, [
        s if {v for v, _ in s.version_spans} - {oldest} else s.model_copy(update={"version_spans": ()}) for s in samples
    ]

"""Multi-turn episodes on the real torch engine (`workers.roles.episodes.run_episodes`).

The tiny model is first taught the tool format (a short supervised loop on the `arithmetic` task's clean
demonstrations: `<call>37*45</call>`, then the observation `<obs>1665</obs>` as context, then the answer), so its
turns call the tool; the environment is an in-test calculator session (pure logic, no bus). What is checked: the
loss mask is 0 on exactly the observation ids the format appends and 1 on the policy's tokens, the engine's
log-probs equal a teacher-forced forward of the whole episode on every policy token, the limits and the failures
end an episode with their reason, a recorded episode resumes where it stopped, and the engine stops a row right
after a stop string.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence
from typing import get_args

import pytest
import torch

from schemas import Sample
from schemas.episode import EpisodeEnd
from workers.data.models import materialize
from workers.data.prompts import prompt_ids
from workers.data.tasks import prompt_text
from workers.data.tokenizer import EOS_ID
from workers.data.tool_tasks import OPERATIONS, arithmetic
from workers.engines.base import SamplingSettings
from workers.engines.torch_engine import TorchEngine
from workers.envs.base import EnvItem, StepResult
from workers.envs.errors import EnvFailed, EnvLost
from workers.envs.formats import TagFormat
from workers.roles.episodes import EpisodeRecord, Limits, group_version, run_episodes
from workers.roles.reward import episode_answer
from workers.training.logprobs import token_logprobs
from workers.training.supervised import demo_ids, sft_tensors

pytestmark = [pytest.mark.workers, pytest.mark.timeout(300)]

SAMPLING = SamplingSettings(temperature=1.0, max_new_tokens=24)
LIMITS = Limits(max_turns=4, max_tokens=96, turn_tokens=24, max_observation_chars=64)
ENDS = set(get_args(EpisodeEnd))
TOLERANCE = 1e-4  # as the engine contract's: the same eager forward, float32


# ---- the taught model and the calculator session ------------------------------------------------------------------


def teach(engine: TorchEngine, steps: int = 200, batch: int = 16, lr: float = 3e-3) -> None:
    """Supervised steps on the clean demonstrations of 512 arithmetic items (observation tokens not trained)."""
    tok = engine.tokenizer
    examples = []
    for item in arithmetic(digits=2, seed=0, limit=512):
        ids, trained = demo_ids(tok, item.demos[0])
        examples.append((prompt_ids(tok, prompt_text(item.parts)), ids, trained))
    model = engine.model
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(0)
    for _ in range(steps):
        chosen = [examples[rng.randrange(len(examples))] for _ in range(batch)]
        ids, attention, mask = sft_tensors([(p, (a, trained)) for p, a, trained in chosen])
        loss = -(token_logprobs(model, ids, attention) * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> TorchEngine:
    """The tiny model (128x2), taught the tag format (~15 s on one thread)."""
    engine = TorchEngine(materialize("tiny:128x2", tmp_path_factory.mktemp("models") / "tiny", seed=0))
    teach(engine)
    return engine


@pytest.fixture
def fmt(engine: TorchEngine) -> TagFormat:
    return TagFormat(engine.tokenizer)


class Calculator:
    """One episode's calculator: `a op b` computed with Python; every action and observation kept."""

    def __init__(
        self,
        replayed: Sequence[str] = (),
        opening: str = "",
        fail: Exception | None = None,
        done: bool = False,
        refuse: bool = False,
    ) -> None:
        self.observation = opening
        self.replays = 0
        self.replayed = list(replayed)
        self.actions: list[str] = []
        self.observations: list[str] = []
        self.fail = fail
        self.done = done
        self.refuse = refuse
        self.closed = False

    async def step(self, action: str) -> StepResult:
        self.actions.append(action)
        if self.fail is not None:
            raise self.fail
        found = None if self.refuse else re.fullmatch(r"(\d+)([+*])(\d+)", action)
        text = str(OPERATIONS[found.group(2)](int(found.group(1)), int(found.group(3)))) if found else "bad call"
        self.observations.append(text)
        return StepResult(observation=text, reward=1.0 if found else 0.0, done=self.done, info={"valid": bool(found)})

    async def close(self) -> None:
        self.closed = True


class Sessions:
    """The opener of the episodes' calculators (or of a failure at reset), and every session it opened."""

    def __init__(self, reset_error: Exception | None = None, **options: object) -> None:
        self.opened: dict[str, Calculator] = {}
        self.reset_error = reset_error
        self.options = options

    async def __call__(self, item: EnvItem, actions: Sequence[str]) -> Calculator:
        if self.reset_error is not None:
            raise self.reset_error
        session = Calculator(actions, **self.options)  # type: ignore[arg-type]
        self.opened[item.episode] = session
        return session


def problems(engine: TorchEngine, count: int, seed: int = 1) -> tuple[list[list[int]], list[EnvItem]]:
    """`count` arithmetic prompts the model was not taught on, as the rollout renders them, and their items."""
    tok = engine.tokenizer
    items = arithmetic(digits=2, seed=seed, limit=count)
    prompts = [prompt_ids(tok, prompt_text(it.parts)) for it in items]
    env_items = [
        EnvItem(episode=f"g{i}/0/0", prompt=prompt_text(it.parts), answer=it.answer) for i, it in enumerate(items)
    ]
    return prompts, env_items


async def episodes(
    engine: TorchEngine,
    fmt: TagFormat,
    sessions: Sessions,
    count: int = 8,
    limits: Limits = LIMITS,
    resumed: Sequence[EpisodeRecord | None] = (),
    records: list[bytes] | None = None,
) -> tuple[list[list[int]], list[EnvItem], list[Sample]]:
    """Run `count` episodes (seeds 100, 101, ...); every record written after a wave goes to `records`, as bytes."""
    prompts, items = problems(engine, count)

    async def record(rec: EpisodeRecord) -> None:
        if records is not None:
            records.append(rec.to_bytes())

    seeds = [100 + i for i in range(count)]
    samples = await run_episodes(engine, fmt, SAMPLING, limits, prompts, items, seeds, sessions, resumed, record)
    return prompts, items, samples


def zero_runs(trained: list[int]) -> list[tuple[int, int]]:
    """The maximal runs of 0 in a loss mask, as (start, end)."""
    runs, start = [], None
    for i, t in enumerate([*trained, 1]):
        if t == 0 and start is None:
            start = i
        elif t == 1 and start is not None:
            runs.append((start, i))
            start = None
    return runs


# ---- episodes -----------------------------------------------------------------------------------------------------


async def test_the_loss_mask_is_zero_on_exactly_the_observation_ids(engine, fmt):
    sessions, records = Sessions(), []
    _, items, samples = await episodes(engine, fmt, sessions, count=12, records=records)
    tok = engine.tokenizer
    assert sum(s.episode.tool_calls > 0 for s in samples) >= 6, [s.text for s in samples]
    assert any(s.episode.ended == "answer" and s.episode.tool_calls > 0 for s in samples), [s.text for s in samples]
    for item, s in zip(items, samples, strict=True):
        info, session = s.episode, sessions.opened[item.episode]
        ids, trained = s.token_ids.to_values(), s.trained()
        assert info.ended in ENDS and session.closed
        assert info.tool_calls == len(session.actions) and session.replayed == []
        # Every observation the calculator gave is appended as the format renders it, nothing else is masked; the
        # last one may be left out when it did not fit in max_tokens (the episode then ends there).
        runs = zero_runs(trained)
        appended = session.observations[: len(runs)]
        assert len(runs) == len(session.observations) or (info.ended == "max_tokens" and len(runs) == len(appended))
        for (start, end), text, action in zip(runs, appended, session.actions, strict=True):
            assert ids[start:end] == fmt.observation_ids(text), (tok.decode(ids[start:end]), text)
            before = tok.decode(ids[:start])
            assert before.endswith("</call>") and fmt.call_of(before[before.rindex("<call>") :]) == action
        assert all(lp == 0.0 for lp, t in zip(s.logprobs.to_values(), trained, strict=True) if t == 0)
        assert all(lp < 0.0 for lp, t in zip(s.logprobs.to_values(), trained, strict=True) if t == 1)
        # Labels: the whole episode is of version 0; the reasons agree with the counts.
        assert s.version_spans == ((0, len(ids)),)
        assert s.finish_reason == ("stop" if info.ended in ("answer", "env_done") else "length")
        assert info.turns == info.tool_calls + (info.ended == "answer") or info.ended in ("max_tokens", "max_turns")
        assert 1 <= info.turns <= LIMITS.max_turns and len(ids) <= LIMITS.max_tokens
        assert info.env_reward == (sum(1.0 for a in session.actions if re.fullmatch(r"\d+[+*]\d+", a)) or None)
        assert info.invalid_calls == sum(o == "bad call" for o in session.observations)
        assert (info.env_errors, info.replays, info.resumed_turns) == (0, 0, 0)
        assert s.text == tok.decode(ids, skip_special_tokens=True)
        if info.ended == "answer":
            assert info.answer == episode_answer(tok, s) and info.answer
        else:
            assert info.answer == ""
    # The group is of version 0 and its samples carry no spans on the wire.
    version, wire = group_version(samples, current=0)
    assert version == 0 and all(w.version_spans == () for w in wire)
    # Records: one per running episode per wave, round-tripping exactly; each episode's last one is its final state.
    last: dict[str, EpisodeRecord] = {}
    for data in records:
        rec = EpisodeRecord.from_bytes(data)
        assert rec.to_bytes() == data
        last[rec.episode] = rec
    assert len(records) == sum(s.episode.turns for s in samples)
    for item, s in zip(items, samples, strict=True):
        rec = last[item.episode]
        assert rec.tokens == s.token_ids.to_values() and rec.trained == s.trained()
        assert rec.logprobs == s.logprobs.to_values() and rec.versions == [0] * len(rec.tokens)
        assert rec.actions == sessions.opened[item.episode].actions and rec.turns == s.episode.turns
        assert rec.started


async def test_the_engines_logprobs_equal_a_teacher_forced_forward_of_the_whole_episode(engine, fmt):
    prompts, _, samples = await episodes(engine, fmt, Sessions(), count=8)
    checked = 0
    for prompt, s in zip(prompts, samples, strict=True):
        if s.episode.tool_calls == 0:
            continue
        ids = torch.tensor([prompt + s.token_ids.to_values()])
        with torch.no_grad():
            forced = token_logprobs(engine.model, ids, torch.ones_like(ids), SAMPLING.temperature)[0, len(prompt) - 1 :]
        policy = torch.tensor(s.trained(), dtype=torch.bool)
        assert 0 < int(policy.sum()) < len(policy)  # observation tokens excluded, policy tokens after them checked
        engine_lp = torch.tensor(s.logprobs.to_values())
        gap = (forced[policy] - engine_lp[policy]).abs().max()
        assert gap < TOLERANCE, gap
        checked += 1
    assert checked >= 4


# ---- limits and failures ------------------------------------------------------------------------------------------


async def test_max_turns_ends_an_episode_still_calling_without_sending_its_last_call(engine, fmt):
    sessions = Sessions()
    _, items, samples = await episodes(engine, fmt, sessions, limits=dataclasses.replace(LIMITS, max_turns=1))
    ended = [s.episode.ended for s in samples]
    assert ended.count("max_turns") >= 4, ended
    for item, s in zip(items, samples, strict=True):
        assert s.episode.turns == 1 and sessions.opened[item.episode].actions == []
        assert set(s.trained()) == {1}  # no observation: the call at the last turn is never sent
        if s.episode.ended == "max_turns":
            assert s.episode.truncated and s.finish_reason == "length" and s.episode.tool_calls == 1
            assert s.text.endswith("</call>")


@pytest.mark.parametrize("max_tokens", [8, 20, 34])
async def test_max_tokens_ends_an_episode_and_is_never_exceeded(engine, fmt, max_tokens):
    limits = dataclasses.replace(LIMITS, max_tokens=max_tokens)
    _, _, samples = await episodes(engine, fmt, Sessions(), limits=limits)
    ended = [s.episode.ended for s in samples]
    assert ended.count("max_tokens") >= 4, ended
    for s in samples:
        assert s.token_ids.numel <= max_tokens
        if s.episode.ended == "max_tokens":
            assert s.episode.truncated and s.finish_reason == "length" and s.episode.answer == ""


@pytest.mark.parametrize("opening", [40, 5, 4])
async def test_an_opening_observation_near_or_over_max_tokens_never_exceeds_the_bound(engine, fmt, opening):
    """`<obs>` + `x` * opening + `</obs>` against a bound of 16: it does not fit (the episode ends before any turn),
    fills the bound exactly, or leaves one token for the policy."""
    limits = dataclasses.replace(LIMITS, max_tokens=16)
    sessions = Sessions(opening="x" * opening)
    _, _, samples = await episodes(engine, fmt, sessions, count=4, limits=limits)
    ids = fmt.opening_ids("x" * opening)
    for s in samples:
        assert s.token_ids.numel <= 16, s.token_ids.numel
        # One token left: an eos there is an answer, anything else is cut.
        assert s.episode.ended == "max_tokens" or (len(ids) == 15 and s.token_ids.to_values()[-1] == EOS_ID)
        if len(ids) > 16:
            assert (s.token_ids.numel, s.episode.turns) == (0, 0)
        else:
            assert s.token_ids.to_values()[: len(ids)] == ids and s.trained() == [0] * len(ids) + [1] * (16 - len(ids))


async def test_an_opening_observation_is_appended_once_untrained(engine, fmt):
    sessions = Sessions(opening="go")
    _, _, samples = await episodes(engine, fmt, sessions, count=4)
    opening = fmt.opening_ids("go")
    for s in samples:
        assert s.token_ids.to_values()[: len(opening)] == opening
        assert s.trained()[: len(opening)] == [0] * len(opening) and s.trained()[len(opening)] == 1


@pytest.mark.parametrize(("error", "reason"), [(EnvFailed("tool crashed"), "env_error"), (EnvLost("gone"), "env_lost")])
async def test_an_environment_failure_at_a_step_ends_the_episode_with_its_reason(engine, fmt, error, reason):
    sessions = Sessions(fail=error)
    _, items, samples = await episodes(engine, fmt, sessions)
    called = [s for s in samples if s.episode.tool_calls > 0]
    assert len(called) >= 4
    for item, s in zip(items, samples, strict=True):
        if s.episode.tool_calls == 0:
            continue
        assert (s.episode.ended, s.episode.env_errors, s.episode.turns) == (reason, 1, 1)
        assert set(s.trained()) == {1} and s.finish_reason == "length"  # no observation came
        assert sessions.opened[item.episode].closed


@pytest.mark.parametrize(
    ("error", "reason"), [(EnvFailed("bad item"), "env_error"), (EnvLost("no instance"), "env_lost")]
)
async def test_an_environment_failure_at_reset_ends_the_episode_before_any_turn(engine, fmt, error, reason):
    _, _, samples = await episodes(engine, fmt, Sessions(reset_error=error), count=3)
    for s in samples:
        assert (s.episode.ended, s.episode.env_errors, s.episode.turns, s.token_ids.numel) == (reason, 1, 0, 0)


async def test_an_environment_that_says_done_ends_the_episode_after_its_observation(engine, fmt):
    sessions = Sessions(done=True)
    _, items, samples = await episodes(engine, fmt, sessions)
    done = [s for s in samples if s.episode.ended == "env_done"]
    assert len(done) >= 4
    for item, s in zip(items, samples, strict=True):
        if s.episode.ended != "env_done":
            continue
        observation = fmt.observation_ids(sessions.opened[item.episode].observations[-1])
        assert s.token_ids.to_values()[-len(observation) :] == observation
        assert s.trained()[-len(observation) :] == [0] * len(observation)
        assert (s.episode.turns, s.episode.tool_calls, s.finish_reason) == (1, 1, "stop")


async def test_an_invalid_call_is_counted_and_the_episode_goes_on(engine, fmt):
    sessions = Sessions(refuse=True)
    _, items, samples = await episodes(engine, fmt, sessions)
    assert sum(s.episode.invalid_calls > 0 for s in samples) >= 4
    for item, s in zip(items, samples, strict=True):
        session = sessions.opened[item.episode]
        assert s.episode.invalid_calls == s.episode.tool_calls == len(session.observations)
        assert s.episode.env_reward == (0.0 if session.actions else None)  # a reward of 0 is still a reward
        assert s.episode.ended in ("answer", "max_turns", "max_tokens")


async def test_a_recorded_episode_resumes_from_its_last_turn_with_its_versions(engine, fmt):
    records: list[bytes] = []
    _, items, whole = await episodes(engine, fmt, Sessions(), records=records)
    first_wave = {}
    for data in records[: len(items)]:  # the records of the first wave: one per episode
        rec = EpisodeRecord.from_bytes(data)
        first_wave[rec.episode] = rec
    resumable = [i for i, it in enumerate(items) if first_wave[it.episode].actions and whole[i].episode.turns > 1]
    assert len(resumable) >= 3
    resumed: list[EpisodeRecord | None] = [None] * len(items)
    for i in resumable:
        rec = first_wave[items[i].episode]
        rec.versions = [3] * len(rec.tokens)  # written by another worker's older weights
        resumed[i] = EpisodeRecord.from_bytes(rec.to_bytes())  # the loop goes on in the record it is given
    sessions = Sessions()
    saved = engine.version
    engine.version = 5
    try:
        _, _, samples = await episodes(engine, fmt, sessions, resumed=resumed)
    finally:
        engine.version = saved
    for i, (item, s) in enumerate(zip(items, samples, strict=True)):
        if i not in resumable:
            assert s.episode.resumed_turns == 0 and s.version_spans == ((5, s.token_ids.numel),)
            continue
        rec = first_wave[item.episode]
        n = len(rec.tokens)
        assert s.token_ids.to_values()[:n] == rec.tokens and s.trained()[:n] == rec.trained
        assert s.logprobs.to_values()[:n] == rec.logprobs
        assert s.episode.resumed_turns == 1 and s.episode.turns == whole[i].episode.turns
        assert s.version_spans == ((3, n), (5, s.token_ids.numel - n))
        assert sessions.opened[item.episode].replayed == rec.actions  # the environment replays the recorded calls
        # The same weights and turn seeds: the resumed episode goes on exactly as the uninterrupted one did.
        assert s.token_ids.to_values() == whole[i].token_ids.to_values()
    version, wire = group_version(samples, current=5)
    assert version == 3
    assert all(w.version_spans == s.version_spans for w, s in zip(wire, samples, strict=True))


async def test_an_episode_recorded_after_its_end_resumes_as_it_ended(engine, fmt):
    """A worker dies after some episodes of its batch ended and were recorded: a resuming worker returns them as
    they ended, never samples a turn after their end."""
    records: list[bytes] = []
    _, items, whole = await episodes(engine, fmt, Sessions(), records=records)
    last: dict[str, EpisodeRecord] = {}
    for data in records:
        rec = EpisodeRecord.from_bytes(data)
        last[rec.episode] = rec
    assert sum(s.episode.ended == "answer" for s in whole) >= 4, [s.episode.ended for s in whole]
    for item, s in zip(items, whole, strict=True):
        assert (last[item.episode].ended, last[item.episode].answer) == (s.episode.ended, s.episode.answer)
    sessions = Sessions()
    _, _, again = await episodes(engine, fmt, sessions, resumed=[last[it.episode] for it in items])
    assert sessions.opened == {}  # nothing left to step: no environment opened
    for w, a in zip(whole, again, strict=True):
        assert a.token_ids.to_values() == w.token_ids.to_values() and a.trained() == w.trained()
        assert a.logprobs.to_values() == w.logprobs.to_values() and a.finish_reason == w.finish_reason
        assert (a.episode.ended, a.episode.answer, a.episode.turns, a.episode.tool_calls) == (
            w.episode.ended,
            w.episode.answer,
            w.episode.turns,
            w.episode.tool_calls,
        )
        assert a.episode.resumed_turns == w.episode.turns


# ---- stop strings in the torch engine -----------------------------------------------------------------------------


def test_a_row_stops_right_after_its_stop_string(engine):
    prompts, _ = problems(engine, 6)
    seeds = list(range(6))
    free = engine.generate(prompts, 2, dataclasses.replace(SAMPLING, max_new_tokens=40), seeds)
    stopped = engine.generate(prompts, 2, dataclasses.replace(SAMPLING, max_new_tokens=40, stop=("</call>",)), seeds)
    hits = 0
    for a_row, b_row in zip(free, stopped, strict=True):
        for a, b in zip(a_row, b_row, strict=True):
            assert a.token_ids[: len(b.token_ids)] == b.token_ids  # the same stream, cut
            assert a.logprobs[: len(b.logprobs)] == pytest.approx(b.logprobs, abs=1e-5)
            if "</call>" in a.text:
                cut = engine.tokenizer.decode(a.token_ids).index("</call>") + len("</call>")
                assert b.text.endswith("</call>") and len(engine.tokenizer.decode(b.token_ids)) == cut
                assert b.finish_reason == "stop" and len(b.token_ids) <= len(a.token_ids)
                hits += 1
            else:
                assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
    assert hits >= 6


def test_the_first_of_several_stop_strings_stops_a_row(engine):
    prompts, _ = problems(engine, 4)
    stops = ("</call>", "*", "+")
    out = engine.generate(prompts, 2, dataclasses.replace(SAMPLING, stop=stops), [7, 8, 9, 10])
    operators = 0
    for g in (g for row in out for g in row):
        ends = [g.text.index(s) + len(s) for s in stops if s in g.text]
        if not ends:
            continue
        assert g.finish_reason == "stop" and min(ends) == len(g.text), g.text  # the first one completed
        operators += g.text[-1] in "*+"
    assert operators >= 4  # a call's operator comes before its closing tag


def test_sampling_settings_refuse_an_empty_stop_string():
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        SamplingSettings(stop=("",))
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        SamplingSettings(stop=("</call>", ""))
    assert SamplingSettings(stop=("</call>",)).stop == ("</call>",)


def test_a_record_that_does_not_hold_together_is_refused() -> None:
    good = EpisodeRecord("g/0/0", tokens=[5, 6], logprobs=[-0.1, 0.0], trained=[1, 0], versions=[2, 2], turns=1)
    assert EpisodeRecord.from_bytes(good.to_bytes()) == good
    torn = dataclasses.replace(good, logprobs=[-0.1])
    with pytest.raises(ValueError, match="differ in length"):
        EpisodeRecord.from_bytes(torn.to_bytes())
    with pytest.raises(ValueError):
        EpisodeRecord.from_bytes(b"\x93\x01\x02\x03")  # a msgpack list, not a map

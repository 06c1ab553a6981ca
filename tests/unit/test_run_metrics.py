"""What a researcher sees of a step beyond the loss: the reward's terms and failures, the responses' lengths and
truncation, the namespaced policy names and the samples log's entries."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from relax_bus.errors import ConfigError
from schemas import (
    ChatTurn,
    EpisodeInfo,
    ImagePart,
    Metric,
    RewardDetail,
    ScoredGroup,
    StepSample,
    TextPart,
    TrainGroup,
    decode,
    encode,
)
from schemas.bounded import MAX_SAMPLE_TEXT, MAX_STEP_SAMPLES, name_part
from tests import factories as f
from workers.config import parse_config
from workers.roles.step_samples import MARK, clip_end, clip_start, prompt_text, step_samples
from workers.training.step_metrics import (
    MAX_REWARD_TERMS,
    policy_aliases,
    response_metrics,
    reward_metrics,
    reward_terms,
)

pytestmark = pytest.mark.unit


def group(i: int, rewards: list[float], details: list[RewardDetail], samples=None) -> TrainGroup:
    """Group `i` of len(rewards) samples ("0", "1", ... unless `samples`) with these rewards and details."""
    p = f.prompt("m", i, n=len(rewards))
    r = f.rollout(p)
    if samples is not None:
        r = r.model_copy(update={"samples": tuple(samples)})
    return TrainGroup(scored=ScoredGroup(rollout=r, rewards=tuple(rewards), details=tuple(details)))


def terms(**components: float) -> RewardDetail:
    return RewardDetail(components=components)


FAILED = RewardDetail(error="ValueError: no answer")


# ---- reward terms and failures -------------------------------------------------------------------------------


def test_reward_terms_are_weighted_means_that_sum_to_the_reward_mean():
    # correct (weight 1) and format (weight 0.5): rewards 1.5, 0.5, 1.0, 0.0; one failed sample left out.
    groups = [
        group(0, [1.5, 0.5], [terms(correct=1.0, format=0.5), terms(correct=0.0, format=0.5)]),
        group(1, [1.0, 0.0, 0.0], [terms(correct=1.0, format=0.0), terms(correct=0.0, format=0.0), FAILED]),
    ]
    m = reward_metrics(groups)
    assert m["reward/correct/mean"] == pytest.approx(2 / 4)
    assert m["reward/format/mean"] == pytest.approx(1 / 4)
    assert m["reward/error_rate"] == pytest.approx(1 / 5)
    assert m["reward/correct/mean"] + m["reward/format/mean"] == pytest.approx((1.5 + 0.5 + 1.0 + 0.0) / 4)


def test_a_term_missing_from_a_sample_counts_zero_there():
    """A python reward returning a dict may leave a key out for some samples: that sample adds nothing to it."""
    m = reward_metrics([group(0, [1.0, 2.0], [terms(a=1.0), terms(a=1.0, b=1.0)])])
    assert m["reward/a/mean"] == pytest.approx(1.0) and m["reward/b/mean"] == pytest.approx(0.5)


def test_term_names_become_metric_name_segments():
    # `fn.key` keeps its dot; a slash or a space would break the name's sections: `_`, and names that become one add.
    m = reward_metrics([group(0, [3.0], [terms(**{"fn.ok": 1.0, "a/b": 1.0, "a b": 1.0})])])
    assert {k for k in m if k.endswith("/mean")} == {"reward/fn.ok/mean", "reward/a_b/mean"}
    assert m["reward/a_b/mean"] == pytest.approx(2.0)
    assert name_part("é/x y") == "__x_y" and name_part("") == "_" and len(name_part("x" * 500)) == 64


def test_at_most_the_first_terms_in_name_order():
    many = {f"t{i:03d}": 1.0 for i in range(MAX_REWARD_TERMS + 8)}
    m = reward_metrics([group(0, [float(len(many))], [terms(**many)])])
    reported = sorted(k for k in m if k.endswith("/mean"))
    assert len(reported) == MAX_REWARD_TERMS and reported[0] == "reward/t000/mean"
    assert list(reward_terms(many)) == sorted(many)[:MAX_REWARD_TERMS]


def test_all_failed_or_no_details_gives_the_error_rate_alone():
    assert reward_metrics([group(0, [0.0, 0.0], [FAILED, FAILED])]) == {"reward/error_rate": 1.0}
    assert reward_metrics([group(0, [1.0, 0.0], [])]) == {"reward/error_rate": 0.0}
    assert reward_metrics([]) == {}


# ---- responses ------------------------------------------------------------------------------------------------


def test_response_lengths_and_truncation():
    cut = f.said("abcd").model_copy(update={"finish_reason": "length"})  # 5 tokens (with eos)
    episode = f.said("x").model_copy(update={"episode": EpisodeInfo(turns=4, ended="max_turns")})  # 2 tokens
    answered = f.said("xy").model_copy(update={"episode": EpisodeInfo(turns=1, ended="answer")})  # 3 tokens
    m = response_metrics([cut, episode, answered, f.said("")])  # the last: 1 token
    assert m == {
        "response/length_mean": pytest.approx((5 + 2 + 3 + 1) / 4),
        "response/length_max": 5.0,
        "response/truncated_fraction": pytest.approx(2 / 4),
    }
    assert response_metrics([]) == {}


def test_policy_aliases_keep_the_existing_names_beside():
    assert policy_aliases({"ppo_clip_frac": 0.25, "loss": 1.0}) == {"policy/clip_fraction": 0.25}
    assert policy_aliases({"loss": 1.0}) == {}


def test_the_new_names_fit_a_metric():
    groups = [group(0, [1.0, 0.0], [terms(correct=1.0), FAILED])]
    values = {**reward_metrics(groups), **response_metrics(list(groups[0].scored.rollout.samples))}
    values |= policy_aliases({"ppo_clip_frac": math.nan})
    point = decode(encode(Metric(run="m", step=1, values=values)))
    assert set(point.values) == set(values) and math.isnan(point.values["policy/clip_fraction"])


# ---- the samples log's entries -------------------------------------------------------------------------------


def test_samples_are_one_per_group_in_release_order_then_the_next_round():
    groups = [group(i, [float(i)] * 3, [terms(exact=float(i))] * 3) for i in (2, 0, 1)]
    picked = step_samples(groups, 4, 256)
    assert [(s.group_id, s.index) for s in picked] == [("g0", 0), ("g1", 0), ("g2", 0), ("g0", 1)]
    assert step_samples(groups, 0, 256) == ()
    assert len(step_samples(groups, 20, 256)) == 9  # every sample the step has


def test_a_logged_sample_carries_reward_terms_version_and_error():
    g = group(3, [1.5, 0.0], [terms(correct=1.0, format=0.5), FAILED])
    g = g.model_copy(update={"scored": g.scored.model_copy(update={"rollout": f.rollout(g.prompt, version=7)})})
    ok, failed = step_samples([g], 2, 256)
    assert (ok.group_id, ok.policy_version, ok.reward, ok.terms) == ("g3", 7, 1.5, {"correct": 1.0, "format": 0.5})
    assert (ok.prompt, ok.response, ok.error, ok.tokens, ok.finish_reason) == ("3+1=", "0", None, 2, "stop")
    assert failed.error == "ValueError: no answer" and failed.terms == {} and failed.reward == 0.0


def test_texts_are_clipped_to_the_byte_cap():
    text = "ab€" * 100  # 5 bytes each
    end, start = clip_end(text, 32), clip_start(text, 32)
    assert len(end.encode()) <= 32 and end.endswith(MARK) and text.startswith(end.removesuffix(MARK))
    assert len(start.encode()) <= 32 and start.startswith(MARK) and text.endswith(start.removeprefix(MARK))
    assert clip_end("short", 32) == "short" == clip_start("short", 32)
    assert clip_end("a\udc80b", 32) == "a?b"  # a lone surrogate cannot go on the wire
    long = group(0, [1.0], [terms(exact=1.0)], samples=[f.said("y" * 300)])
    (entry,) = step_samples([long], 1, 64)
    assert len(entry.response.encode()) <= 64 and entry.tokens == 301


def test_the_prompt_text_shows_history_and_media():
    p = f.prompt("m", 0).model_copy(
        update={
            "history": (ChatTurn(role="system", content="Be brief."),),
            "parts": (TextPart(text="What is "), ImagePart(mime="image/png", inline=b"\x89PNG"), TextPart(text="?")),
        }
    )
    assert prompt_text(p) == "system: Be brief.\nWhat is <image>?"


def test_the_schema_bounds_the_samples():
    sample = StepSample(group_id="g", index=0, policy_version=0, prompt="p", response="r", reward=1.0)
    point = Metric(run="m", step=1, values={}, samples=(sample,))
    assert decode(encode(point)) == point
    with pytest.raises(ValidationError):
        Metric(run="m", step=1, values={}, samples=(sample,) * (MAX_STEP_SAMPLES + 1))
    with pytest.raises(ValidationError):
        sample.model_validate({**sample.model_dump(), "response": "x" * (MAX_SAMPLE_TEXT + 1)})
    with pytest.raises(ValidationError):
        sample.model_validate({**sample.model_dump(), "terms": {"a b": 1.0}})


def test_the_samples_settings():
    m = parse_config({"run": "m"}).metrics
    assert (m.samples_per_step, m.sample_text_bytes) == (4, 2048)
    with pytest.raises(ConfigError, match="samples_per_step"):
        parse_config({"run": "m", "metrics": {"samples_per_step": MAX_STEP_SAMPLES + 1}})
    with pytest.raises(ConfigError, match="sample_text_bytes"):
        parse_config({"run": "m", "metrics": {"sample_text_bytes": MAX_SAMPLE_TEXT + 1}})

"""What a researcher sees of a step beyond the loss: the reward's terms and failures, the responses' lengths and
truncation, the namespaced policy names, the samples log's entries, and the reward curve's axis and lines."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from relax_bus.errors import ConfigError
from schemas import (
    ChatTurn,
    EpisodeInfo,
    ImagePart,
    Judgement,
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
from workers.launch.compare import compare
from workers.launch.curve import draw_curve, extra_lines, moving_average, term_names, y_limits
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


def test_a_judged_sample_carries_the_judges_verdict_checks_and_prompt():
    g = group(4, [0.9, 0.0], [RewardDetail(components={"judge": 0.9}, checks={"exact": 0.0}), FAILED])
    rollout = g.scored.rollout.model_copy(update={"judgements": (Judgement(score=0.9), Judgement(error="timeout"))})
    g = g.model_copy(update={"scored": g.scored.model_copy(update={"rollout": rollout})})
    judged, failed = step_samples([g], 2, 256, "{prompt}{response}\nanswer: {reference}\nverdict:")
    assert (judged.verdict, judged.checks, judged.terms) == (0.9, {"exact": 0.0}, {"judge": 0.9})
    assert judged.judge_prompt == f"4+1=0\nanswer: {g.prompt.answer}\nverdict:"  # what the judge was asked
    assert failed.verdict is None and failed.error == "ValueError: no answer"
    (plain,) = step_samples([group(0, [1.0], [terms(exact=1.0)])], 1, 256)  # a run without a judge
    assert (plain.verdict, plain.checks, plain.judge_prompt) == (None, {}, None)
    (clipped,) = step_samples([g], 1, 16, "{response}" + "x" * 100)
    assert len(clipped.judge_prompt.encode()) <= 16 and clipped.judge_prompt.startswith(MARK)  # type: ignore[union-attr]


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


# ---- the reward curve ---------------------------------------------------------------------------------------


def test_the_y_axis_is_zero_to_one_for_rewards_within_it_and_follows_the_data_outside():
    assert y_limits([0.2, 0.9, math.nan]) == pytest.approx((-0.02, 1.02))
    assert y_limits([]) == pytest.approx((-0.02, 1.02))
    low, high = y_limits([0.5, 1.5])
    assert low == pytest.approx(-0.03) and high == pytest.approx(1.53)  # 2 % of the range [0, 1.5] each side
    low, high = y_limits([-0.5, 0.5, math.inf])
    assert low == pytest.approx(-0.53) and high == pytest.approx(1.03)


def row(step: int, reward: float, **more: float) -> dict[str, float]:
    return {"step": step, "wall_s": float(step), "reward_mean": reward, **more}


def test_term_lines_only_for_two_terms_or_more_and_modalities_apart():
    one = [row(1, 1.0, **{"reward/exact/mean": 1.0, "reward/error_rate": 0.0})]
    assert term_names(one) == ["exact"] and extra_lines(one) == []
    two = [row(1, 1.5, **{"reward/correct/mean": 1.0, "reward/format/mean": 0.5, "reward/image": 1.0})]
    assert [line.name for line in extra_lines(two)] == ["reward/image", "reward/correct/mean", "reward/format/mean"]


def write_rows(path: Path, rows: list[dict[str, float]]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path / "metrics.jsonl"


@pytest.fixture
def saved_axes(monkeypatch):
    """The y-limits and line labels of every figure saved: what the PNG shows."""
    from matplotlib.figure import Figure

    saved: list[tuple[tuple[float, float], list[str]]] = []
    save = Figure.savefig

    def recording(fig, *args, **kwargs):
        ax = fig.axes[0]
        saved.append((ax.get_ylim(), [line.get_label() for line in ax.get_lines()]))
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording)
    return saved


def test_the_curve_draws_a_reward_above_one_and_its_terms(tmp_path, saved_axes):
    # terms a (1.0) and b (0.5 down to -0.3): the reward runs from 1.4 to 0.7, with a step that has none
    rows = [row(s, 1.5 - 0.1 * s, **{"reward/a/mean": 1.0, "reward/b/mean": 0.5 - 0.1 * s}) for s in range(1, 9)]
    rows[3]["reward_mean"] = math.nan
    png = draw_curve(write_rows(tmp_path, rows), tmp_path / "curve.png")
    assert png is not None and png.stat().st_size > 0
    ((low, high), labels) = saved_axes[0]
    # drawn: the reward (1.4 at the top) and the terms' moving averages (b's ends at -0.1): 2 % of 1.5 more each side
    assert (low, high) == pytest.approx((-0.13, 1.43))
    assert [label for label in labels if label.startswith("reward/")] == [
        "reward/a/mean (moving average 5)",
        "reward/b/mean (moving average 5)",
    ]
    assert moving_average([1.0, math.nan, 3.0], 2) == [1.0, 1.0, 3.0]
    assert math.isnan(moving_average([math.nan], 5)[0])


def test_a_reward_within_zero_and_one_keeps_the_axis_and_compare_follows_its_runs(tmp_path, saved_axes):
    draw_curve(write_rows(tmp_path / "a", [row(s, s / 10) for s in range(1, 6)]), tmp_path / "a.png")
    assert saved_axes[-1][0] == pytest.approx((-0.02, 1.02))
    write_rows(tmp_path / "b", [row(s, 2.0) for s in range(1, 6)])
    text, _ = compare([tmp_path / "a", tmp_path / "b"], tmp_path / "both.png")
    assert saved_axes[-1][0] == pytest.approx((-0.04, 2.04)) and (tmp_path / "both.png").is_file(), text

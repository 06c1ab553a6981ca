"""The generative reward model: verdicts read from a judge's logits or text, how they join the reward (and how a
missing one leaves a sample out), the step's judge figures, the config and the judge trainer's inputs."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from relax_bus.settings import ConfigError
from schemas import Judgement, RewardDetail, ScoredGroup, TrainGroup
from tests.workers.test_trainer import engine_groups
from workers.config import parse_config
from workers.data.models import load_model, load_tokenizer, materialize
from workers.data.tasks import load_task, prompt_text
from workers.engines.torch_engine import TorchEngine
from workers.launch.judge_data import (
    Labelled,
    contrast_pairs,
    logged_pairs,
    policy_pairs,
    read_labelled,
    task_pairs,
)
from workers.launch.judge_train import HELD_OUT_MAX, agreement, held_out
from workers.rewards.judge import Judge, judge_prompt, parse_verdict
from workers.rewards.scorer import Scorer
from workers.roles.reward import Judged, score_group
from workers.training.batch import make_batch
from workers.training.judge_metrics import judge_metrics

pytestmark = pytest.mark.workers


def config(**judge):
    return parse_config({"run": "judge", "judge": {"source": "tiny:64x2", "yes_text": "yes", "no_text": "no", **judge}})


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return materialize("tiny:64x2", tmp_path_factory.mktemp("judge") / "j", seed=3)


# ---- verdicts --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "score"),
    [(" yes", 1.0), ("Yes.", 1.0), ("no, it is 8", 0.0), ("NO", 0.0), ("maybe", None), ("", None), ("yesno", None)],
)
def test_a_text_verdict_is_its_first_word(text, score):
    assert parse_verdict(text, " yes", " no") == score


def test_the_template_is_filled_and_checked():
    assert judge_prompt("Q {prompt} A {response} R {reference}", "1+2=", "3", None) == "Q 1+2= A 3 R "
    with pytest.raises(ConfigError, match="unknown template fields"):
        config(template="{prompt}{answer}")
    with pytest.raises(ConfigError, match="must contain"):
        config(template="{prompt}")


def test_p_yes_is_the_softmax_of_the_two_verdict_logits_whatever_the_padding(judge_dir):
    cfg = config().judge
    assert cfg is not None
    model, tokenizer = load_model(judge_dir), load_tokenizer(judge_dir)
    judge = Judge(model, tokenizer, cfg)
    texts = ["1+2=3\nverdict:", "7+8=15 and some more text\nverdict:", "0+0=0\nverdict:"]
    batched = [j.score for j in judge.judge(texts)]
    y, n = tokenizer.encode("y", add_special_tokens=False)[0], tokenizer.encode("n", add_special_tokens=False)[0]
    for text, got in zip(texts, batched, strict=True):
        ids = torch.tensor([judge.ids(text)])
        with torch.no_grad():
            last = model(input_ids=ids).logits[0, -1]
        expected = float(torch.softmax(last[[y, n]], dim=-1)[0])
        assert got is not None and abs(got - expected) < 1e-5, (text, got, expected)


def test_a_threshold_makes_p_yes_a_hard_verdict(judge_dir):
    model, tokenizer = load_model(judge_dir), load_tokenizer(judge_dir)
    texts = ["1+2=3\nverdict:", "7+8=15 and some more text\nverdict:", "0+0=0\nverdict:", "9+9=1\nverdict:"]
    soft = [j.score for j in Judge(model, tokenizer, config().judge).judge(texts)]  # type: ignore[arg-type]
    assert all(s is not None and 0.0 < s < 1.0 for s in soft)
    cut = sorted(soft)[1] + 1e-6  # type: ignore[type-var]
    hard = Judge(model, tokenizer, config(threshold=cut).judge).judge(texts)  # type: ignore[arg-type]
    assert [j.score for j in hard] == [float(s >= cut) for s in soft]  # type: ignore[operator]
    assert sorted(j.score for j in hard) == [0.0, 0.0, 1.0, 1.0]  # type: ignore[type-var]
    with pytest.raises(ConfigError, match="threshold"):
        config(threshold=1.0)
    with pytest.raises(ConfigError, match="threshold applies to verdict: logits"):
        config(threshold=0.5, verdict="text")


def test_a_judges_agreement_is_balanced_over_right_and_wrong_pairs():
    said, labels = [True, True, True, False, True], [True, False, False, False, False]
    got = agreement(said, labels)
    assert got["agreement"] == pytest.approx(2 / 5)
    assert got["false_positive_rate"] == pytest.approx(3 / 4)  # yes to three of the four wrong ones
    assert got["balanced_agreement"] == pytest.approx((1.0 + 1 / 4) / 2)
    assert agreement([False] * 4, [False, False, False, True])["balanced_agreement"] == 0.5  # "no" to all: chance
    assert agreement([True, False], [True, True])["balanced_agreement"] == 0.5  # one label only: the plain share


def test_text_verdicts_that_say_neither_are_errors_not_zeros(judge_dir):
    cfg = config(verdict="text", max_new_tokens=3).judge
    assert cfg is not None
    found = Judge(load_model(judge_dir), load_tokenizer(judge_dir), cfg).judge(["1+2=3\nverdict:"] * 2)
    # An untrained judge writes bytes at random: what it writes decides, and a score is never made up.
    for j in found:
        if j.score is None:
            assert j.error is not None and j.error.startswith("unparsable verdict")
        else:
            assert parse_verdict(j.verdict, "yes", "no") == j.score
    with pytest.raises(ValueError, match="a score or an error"):
        Judgement()


# ---- the reward -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    model_dir = materialize("tiny:64x2", tmp_path_factory.mktemp("policy") / "p", seed=1)
    return [g.scored.rollout for g in engine_groups(TorchEngine(model_dir), ["1+2="], n=4)]


def test_the_judges_score_joins_the_weighted_rules_and_a_missing_verdict_leaves_the_sample_out(groups):
    (rollout,) = groups
    verdicts = (
        Judgement(score=0.9),
        Judgement(score=0.2),
        Judgement(error="judge timeout after 60 s"),
        Judgement(score=1.0),
    )
    judged = rollout.model_copy(update={"judgements": verdicts})
    exact = Scorer(list(parse_config({"run": "r", "rewards": [{"type": "exact", "weight": 0.5}]}).rewards))
    check = Scorer(list(parse_config({"run": "r", "rewards": [{"type": "exact"}]}).rewards))
    scored = score_group(exact, judged, answer="3", judged=Judged(2.0, check, "exact"))
    for sample, reward, detail, verdict in zip(rollout.samples, scored.rewards, scored.details, verdicts, strict=True):
        right = sample.text.strip() == "3" and sample.finish_reason == "stop"
        if verdict.score is None:
            assert reward == 0.0 and detail.error == "judge: judge timeout after 60 s" and detail.components == {}
        else:
            assert reward == pytest.approx(0.5 * right + 2.0 * verdict.score)
            assert detail.components["judge"] == pytest.approx(2.0 * verdict.score) and detail.error is None
        assert detail.checks == {"exact": float(right)}  # logged, never rewarded
    batch = make_batch([TrainGroup(scored=scored)])
    assert batch.valid is not None and batch.valid.tolist() == [[True, True, False, True]]
    assert float(batch.mask[2].sum()) == 0.0  # the sample without a verdict trains nothing


def test_without_rules_a_judged_run_is_rewarded_by_the_judge_alone(groups):
    (rollout,) = groups
    judged = rollout.model_copy(update={"judgements": tuple(Judgement(score=0.25) for _ in rollout.samples)})
    scored = score_group(None, judged, answer="3", judged=Judged(1.0))
    assert scored.rewards == (0.25,) * 4 and all(d.components == {"judge": 0.25} for d in scored.details)


def test_the_step_reports_errors_agreement_and_false_positives_against_the_check(groups):
    (rollout,) = groups
    verdicts = (Judgement(score=0.9), Judgement(score=0.8), Judgement(error="x"), Judgement(score=0.1))
    checks = ({"exact": 1.0}, {"exact": 0.0}, {"exact": 0.0}, {"exact": 0.0})
    scored = ScoredGroup(
        rollout=rollout.model_copy(update={"judgements": verdicts}),
        rewards=(0.0,) * 4,
        details=tuple(RewardDetail(checks=c) for c in checks),
    )
    got = judge_metrics([TrainGroup(scored=scored)], "exact")
    assert got["judge_error_rate"] == 0.25
    assert got["judge_score_mean"] == pytest.approx(0.6)
    assert got["judge_check_mean"] == 0.25  # over every sample with a check, the judged-out one included
    assert got["judge_agreement"] == pytest.approx(2 / 3)  # yes/right, yes/wrong, no/wrong
    assert got["judge_false_positive_rate"] == pytest.approx(1 / 3)
    assert got["judge_yes_on_wrong"] == pytest.approx(1 / 2)  # of the two wrong samples with a verdict, one a yes
    assert judge_metrics([TrainGroup(scored=ScoredGroup(rollout=rollout, rewards=(0.0,) * 4))], "exact") == {}
    assert math.isnan(judge_metrics([TrainGroup(scored=scored)], "other")["judge_agreement"])


# ---- the config and the trainer's inputs -------------------------------------------------------------------------


def test_the_genrm_role_sits_before_the_reward_role():
    chain = [(r.name, r.input, r.output) for r in config().chain]
    assert chain[1:4] == [
        ("rollout", "prompts", "rollouts"),
        ("genrm", "rollouts", "judged"),
        ("reward", "judged", "train"),
    ]
    assert "genrm" not in [r.name for r in parse_config({"run": "r"}).chain]
    with pytest.raises(ConfigError, match="no genrm role"):
        parse_config({"run": "r", "roles": {"genrm": 2}})


def test_task_pairs_are_the_answer_and_near_misses(tmp_path):
    items = load_task({"type": "addition", "seed": 0})[:20]
    pairs = task_pairs(items, wrong_per_item=4, seed=0)
    assert len(pairs) == 100 and sum(p.label for p in pairs) == 20
    assert all((p.response == p.reference) == p.label for p in pairs)
    with pytest.raises(ValueError, match="whole-number answers"):
        task_pairs(load_task({"type": "reverse", "seed": 0})[:2])


def test_policy_pairs_are_the_policys_samples_labelled_by_the_rule(tmp_path):
    cfg = parse_config(
        {
            "run": "judge",
            "model": {"source": "tiny:64x2"},
            "task": {"type": "addition", "options": {"seed": 0}},
            "rollout": {"max_new_tokens": 3},
            "judge": {"source": "tiny:64x2", "check": {"type": "exact"}},
            "trainer": {"warmup": {"max_steps": 2, "check_every": 1, "lr": 3e-3, "noise_steps": 1, "label_noise": 0.5}},
        }
    )
    rounds: list[dict[str, float]] = []
    pairs = policy_pairs(cfg, samples_per_item=2, on_sampled=rounds.append, contrasts=0, warmed=tmp_path / "policy")
    assert (tmp_path / "policy" / "config.json").is_file()  # the policy as its warm-up left it: a judge's base
    load_model(tmp_path / "policy")
    items = load_task({"type": "addition", "seed": 0})
    assert [r["step"] for r in rounds] == [0.0, 1.0, 2.0, -1.0]  # before, at each check, at the end
    assert len(pairs) == 4 * 2 * len(items) and all(r["samples"] == 2 * len(items) for r in rounds)
    assert all(p.response.strip() == p.reference for p in pairs if p.label)  # exact: right only when it is the answer
    assert {p.prompt for p in pairs} == {prompt_text(i.parts) for i in items}
    assert len({p.response for p in pairs}) > 10  # sampled, not the answers: the untrained policy babbles


def test_contrast_pairs_set_every_item_against_the_commonest_responses():
    sampled = [
        Labelled("1+1=", "2", "2", True),
        Labelled("1+1=", "3", "2", False),
        Labelled("2+2=", "3", "4", False),
        Labelled("2+2=", "3", "4", False),
        Labelled("3+3=", "7", "6", False),
    ]
    got = contrast_pairs(sampled, lambda response, reference: response == reference, most=2)
    # the two commonest responses ("3", then "2"), the empty one and the reference, less what the item already has
    assert {(p.prompt, p.response, p.label) for p in got} == {
        ("1+1=", "", False),
        ("2+2=", "2", False),
        ("2+2=", "", False),
        ("2+2=", "4", True),
        ("3+3=", "3", False),
        ("3+3=", "2", False),
        ("3+3=", "", False),
        ("3+3=", "6", True),
    }
    assert len(got) == 8 and all(p.reference == {"1+1=": "2", "2+2=": "4", "3+3=": "6"}[p.prompt] for p in got)


def test_labelled_data_errors_name_the_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    good = [json.dumps({"prompt": "1+1=", "response": "2", "label": True})] * 10
    path.write_text("\n".join([*good, json.dumps({"prompt": "1+1=", "response": "3", "label": "no"})]))
    with pytest.raises(ValueError, match=r"pairs.jsonl:11: label must be true or false"):
        read_labelled(path)
    path.write_text("\n".join([*good, "{"]))
    with pytest.raises(ValueError, match=r"pairs.jsonl:11: not a labelled pair"):
        read_labelled(path)
    path.write_text("\n".join(good[:3]))
    with pytest.raises(ValueError, match="at least 10"):
        read_labelled(path)
    path.write_text("\n".join(good))
    assert len(read_labelled(path)) == 10


def test_logged_samples_are_relabelled_by_the_rule_and_the_judges_false_yeses_counted(tmp_path):
    cfg = parse_config(
        {
            "run": "judge",
            "task": {"type": "addition", "options": {"seed": 0}},
            "judge": {"source": "tiny:64x2", "check": {"type": "exact"}},
        }
    )

    def row(prompt, response, verdict, **extra):
        return json.dumps({"step": 1, "prompt": prompt, "response": response, "verdict": verdict, **extra})

    log = tmp_path / "samples.jsonl"
    rows = [
        row("2+3=", "5", 1.0),  # right, and judged so
        row("2+3=", "6", 1.0),  # wrong, judged right: what the retrain is for
        row("2+3=", "6", 1.0),  # the same pair again: one pair, but the judge's two yeses count
        row("0+8=", "9", 0.0),  # wrong, judged wrong
        row("0+8=", "8", None, error="the judge timed out"),  # failed: its reward was not the judge's
        row("…3=", "5", 1.0),  # a prompt the log clipped
        row("1+1=", "2…", 1.0),  # a response the log clipped
        row("9+9+9=", "27", 1.0),  # not an item of the task
        row("1+1=", "2", 1.0, finish_reason="length"),  # cut off: the rule says wrong, whatever the text
    ]
    log.write_text("\n".join(rows) + "\n")
    pairs, counts = logged_pairs(cfg, [log])
    assert [(p.prompt, p.response, p.reference, p.label) for p in pairs] == [
        ("2+3=", "5", "5", True),
        ("2+3=", "6", "5", False),
        ("2+3=", "6", "5", False),  # as often as the policy gave it
        ("0+8=", "9", "8", False),
        ("1+1=", "2", "2", False),
    ]
    assert counts == {
        "distinct": 4,
        "logged": 9,
        "failed": 1,
        "clipped": 2,
        "foreign": 1,
        "judged_wrong": 4,
        "judge_said_yes": 3,
    }
    log.write_text(rows[0] + "\n{\n")
    with pytest.raises(ValueError, match=r"samples.jsonl:2: not a logged sample"):
        logged_pairs(cfg, [log])
    log.write_text(rows[7] + "\n")
    with pytest.raises(ValueError, match=r"no usable sample in .*1 logged: 0 failed, 0 clipped, 1 not items"):
        logged_pairs(cfg, [log])
    with pytest.raises(ValueError, match="is not a file"):
        logged_pairs(cfg, [tmp_path / "none.jsonl"])


def test_a_pair_given_several_times_is_held_out_whole_or_trained_on_whole():
    pairs = [Labelled(f"{k}+0=", str(k), str(k), True) for k in range(30) for _ in range(k % 3 + 1)]
    test, train = held_out(pairs, random.Random(0))
    assert sorted(test + train, key=repr) == sorted(pairs, key=repr)
    assert 6 <= len(test) <= 8 and not set(test) & set(train)  # about a tenth of the 60, whole pairs
    big = [Labelled(str(k), "x", None, k % 2 == 0) for k in range(20_000)]
    assert len(held_out(big, random.Random(0))[0]) == HELD_OUT_MAX
    repeated = [Labelled("1+1=", "3", "2", False)] * 3000 + big
    for seed in range(5):  # the pair given 3,000 times is never held out: it would pass the bound
        test, train = held_out(repeated, random.Random(seed))
        assert len(test) == HELD_OUT_MAX and train.count(repeated[0]) == 3000

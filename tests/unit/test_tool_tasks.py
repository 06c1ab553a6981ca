"""The agentic task's data: `tool_tasks.arithmetic` and its demonstrations, the warm-up's ids of a demonstration
(`supervised.demo_ids`), and the final answer the reward role reads from an episode's ids (`reward.episode_answer`)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from schemas import EpisodeInfo, Sample, WireTensor
from workers.data.byte_text import ByteDecoder
from workers.data.tasks import prompt_text
from workers.data.tokenizer import EOS_ID, build_byte_tokenizer
from workers.data.tool_tasks import OPERATIONS, arithmetic
from workers.roles.reward import episode_answer
from workers.training.supervised import demo_ids, item_target

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_byte_tokenizer()


# ---- arithmetic ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("digits", "operations", "count"), [(1, "+", 100), (1, "+*", 200), (2, "*", 8100), (2, "+*", 16200)]
)
def test_arithmetic_holds_every_problem_of_its_digits_once(digits, operations, count):
    items = arithmetic(digits=digits, operations=operations, tool=False)  # the demonstrations are tested below
    assert len(items) == count
    seen = set()
    for i, it in enumerate(items):
        a, op, b = re.fullmatch(r"(\d+)([+*])(\d+)=", prompt_text(it.parts)).groups()  # type: ignore[union-attr]
        assert op in operations and (it.index, it.task) == (i, "arithmetic")
        for n in (a, b):
            assert len(n) == digits and (digits == 1 or n[0] != "0")
        assert it.answer == str(OPERATIONS[op](int(a), int(b)))
        seen.add((a, op, b))
    assert len(seen) == count


def test_arithmetic_shuffles_by_seed_and_limits():
    plain = arithmetic(digits=1)
    a, b, other = arithmetic(digits=1, seed=3), arithmetic(digits=1, seed=3), arithmetic(digits=1, seed=4)
    texts = [[prompt_text(it.parts) for it in items] for items in (plain, a, b, other)]
    assert texts[1] == texts[2] and texts[1] != texts[0] and texts[1] != texts[3]
    assert sorted(texts[1]) == sorted(texts[0])
    assert texts[0][:3] == ["0+0=", "0+1=", "0+2="]
    limited = arithmetic(digits=2, seed=3, limit=5)
    whole = arithmetic(digits=2, seed=3, tool=False)[:5]
    assert [(it.parts, it.answer) for it in limited] == [(it.parts, it.answer) for it in whole]
    assert prompt_text(arithmetic(digits=1, template="What is {a} {op} {b}?")[1].parts) == "What is 0 + 1?"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"digits": 0}, "digits must be 1 to 4"),
        ({"digits": 5}, "digits must be 1 to 4"),
        ({"operations": "-"}, "operations must be some of"),
        ({"operations": ""}, "operations must be some of"),
        ({"template": "{a}{x}{b}="}, "may only name"),
        ({"limit": 0}, "limit must be at least 1"),
    ],
)
def test_arithmetic_refuses_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        arithmetic(**options)


def test_arithmetic_demonstrations_are_the_clean_direct_and_miscalled_ones():
    items = arithmetic(digits=2, seed=0, limit=300, miscalls=0.3)
    for it in items:
        a, op, b = re.fullmatch(r"(\d+)([+*])(\d+)=", prompt_text(it.parts)).groups()  # type: ignore[union-attr]
        clean, *noisy = it.demos
        assert len(noisy) == 10 and len(set(noisy)) == 2  # 3 miscalled, 7 direct: the warm-up draws among them
        miscalled, direct = noisy[0], noisy[-1]
        assert noisy.count(miscalled) == 3
        assert clean == ((f"<call>{a}{op}{b}</call>", True), (f"<obs>{it.answer}</obs>", False), (it.answer, True))
        assert direct == ((it.answer, True),)
        (call, call_trained), (obs, obs_trained), (said, said_trained) = miscalled
        assert (call_trained, obs_trained, said_trained) == (True, False, True)
        wa, wop, wb = re.fullmatch(r"<call>(\d+)([+*])(\d+)</call>", call).groups()  # type: ignore[union-attr]
        assert (wa, wop) == (a, op) and abs(int(wb) - int(b)) == 1 and len(wb) == len(b)  # one digit off, still 2
        wrong = str(OPERATIONS[op](int(a), int(wb)))
        assert obs == f"<obs>{wrong}</obs>" and said == wrong and wrong != it.answer  # copied faithfully
    assert arithmetic(digits=2, seed=0, limit=300, miscalls=0.3)[7].demos == items[7].demos  # reproducible


def test_arithmetic_without_the_tool_has_no_demonstrations():
    with_tool, without = arithmetic(digits=1, seed=2), arithmetic(digits=1, seed=2, tool=False)
    assert all(it.demos == () for it in without)
    assert [(it.parts, it.answer) for it in without] == [(it.parts, it.answer) for it in with_tool]


# ---- warm-up ids --------------------------------------------------------------------------------------------------


def test_demo_ids_are_the_segments_ids_then_eos_with_the_observation_untrained(tok):
    demo = (("<call>37*45</call>", True), ("<obs>1665</obs>", False), ("1665", True))
    ids, trained = demo_ids(tok, demo)
    assert ids == [*b"<call>37*45</call><obs>1665</obs>1665", EOS_ID]
    assert trained == [1] * 18 + [0] * 15 + [1] * 4 + [1]  # the eos is the policy's: it ends the answer
    assert len(ids) == len(trained)
    # Each segment's ids are where its trained flag says.
    at = 0
    for text, train in demo:
        n = len(tok.encode(text, add_special_tokens=False))
        assert tok.decode(ids[at : at + n]) == text and set(trained[at : at + n]) == {int(train)}
        at += n
    assert ids[at:] == [EOS_ID] and at == len(ids) - 1


def test_the_warmup_target_of_an_item_is_its_clean_demonstration_or_its_answer(tok):
    item = arithmetic(digits=2, seed=0, limit=1)[0]
    assert item_target(tok, item) == demo_ids(tok, item.demos[0])
    plain = arithmetic(digits=2, seed=0, limit=1, tool=False)[0]
    ids, trained = item_target(tok, plain)
    assert ids[-1] == EOS_ID and tok.decode(ids[:-1]) == plain.answer and trained == [1] * len(ids)


# ---- the final answer of an episode --------------------------------------------------------------------------------


def episode(segments: list[tuple[str, int]], ended: str, answer: str = "") -> Sample:
    ids, trained = [], []
    for text, train in segments:
        ids += list(text.encode())
        trained += [train] * len(text.encode())
    return Sample(
        token_ids=WireTensor.from_values(ids, "int32"),
        logprobs=WireTensor.from_values([0.0] * len(ids), "float32"),
        loss_mask=WireTensor.from_values(trained, "uint8"),
        episode=EpisodeInfo(turns=2, tool_calls=1, ended=ended, answer=answer),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("decoder", [build_byte_tokenizer(), ByteDecoder()], ids=["tokenizer", "byte-decoder"])
def test_an_episode_answer_is_its_last_trained_run_when_it_answered(decoder):
    s = episode([("<call>37*45</call>", 1), ("<obs>1665</obs>", 0), ("It is 1665", 1)], "answer", "claimed")
    assert episode_answer(decoder, s) == "It is 1665"  # read from the ids, not from the info's text
    both = episode(
        [("<call>1+2</call>", 1), ("<obs>3</obs>", 0), ("x<call>2+2</call>", 1), ("<obs>4</obs>", 0), ("4", 1)],
        "answer",
    )
    assert episode_answer(decoder, both) == "4"
    assert episode_answer(decoder, episode([("1665", 1)], "answer")) == "1665"  # answered at once: all of it


@pytest.mark.parametrize("ended", ["env_done", "max_turns", "max_tokens", "env_error", "env_lost"])
def test_an_episode_that_did_not_answer_has_no_answer(ended):
    s = episode([("<call>37*45</call>", 1), ("<obs>1665</obs>", 0), ("1665", 1)], ended)
    assert episode_answer(ByteDecoder(), s) == ""


def test_a_one_turn_sample_has_no_episode_answer():
    s = Sample(token_ids=WireTensor.from_values([49], "int32"), logprobs=WireTensor.from_values([0.0], "float32"))
    assert episode_answer(ByteDecoder(), s) == ""
    assert episode_answer(None, episode([("<obs>1</obs>", 0), ("1", 1)], "answer", "from info")) == "from info"

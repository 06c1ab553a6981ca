"""Task loaders (addition, reverse, jsonl) and the reward scorer, user code in its sandboxed child included."""

from __future__ import annotations

import base64
import json

import pytest

from schemas.parts import AudioPart, ImagePart, MediaRef, TextPart
from workers.config import ExactReward
from workers.data.tasks import TaskItem, load_task, prompt_text
from workers.rewards.scorer import Scorer, default_rewards

pytestmark = pytest.mark.workers

FNS = "tests.workers.reward_fns"


# --- tasks -----------------------------------------------------------------------------------------


def test_addition_has_100_distinct_correct_problems():
    items = load_task({"type": "addition"})
    assert len(items) == 100
    assert len({prompt_text(i.parts) for i in items}) == 100
    for i, item in enumerate(items):
        a, b = prompt_text(item.parts).removesuffix("=").split("+")
        assert item.answer == str(int(a) + int(b))
        assert (item.task, item.index) == ("addition", i)


def test_addition_shuffles_deterministically_and_limits():
    def prompts(spec):
        return [prompt_text(i.parts) for i in load_task(spec)]

    plain = prompts({"type": "addition"})
    shuffled = prompts({"type": "addition", "seed": 7})
    assert shuffled == prompts({"type": "addition", "seed": 7})
    assert shuffled != plain and sorted(shuffled) == sorted(plain)
    assert shuffled != prompts({"type": "addition", "seed": 8})
    assert prompts({"type": "addition", "seed": 7, "limit": 5}) == shuffled[:5]


def test_addition_two_digits():
    items = load_task({"type": "addition", "digits": 2, "seed": 1, "limit": 50})
    assert len(items) == 50
    assert all(str(sum(map(int, prompt_text(i.parts)[:-1].split("+")))) == i.answer for i in items)
    assert len(load_task({"type": "addition", "digits": 2})) == 10_000


def test_reverse_is_correct_and_deterministic():
    items = load_task({"type": "reverse", "min_len": 2, "max_len": 5, "count": 40, "seed": 3})
    assert len(items) == 40
    words = set()
    for item in items:
        text = prompt_text(item.parts)
        assert text.startswith("rev:") and text.endswith("=")
        word = text[4:-1]
        assert 2 <= len(word) <= 5 and word.isalpha() and word.islower()
        assert item.answer == word[::-1] and item.task == "reverse"
        words.add(word)
    assert len(words) == 40
    assert items == load_task({"type": "reverse", "min_len": 2, "max_len": 5, "count": 40, "seed": 3})


def test_unknown_task_type_and_option_are_clear():
    known = "addition, arithmetic, hf, jsonl, omni, reverse"
    with pytest.raises(ValueError, match=rf"unknown task type 'nope'; known types: {known}"):
        load_task({"type": "nope"})
    with pytest.raises(ValueError, match=r"task 'addition'.*'colour'"):
        load_task({"type": "addition", "colour": "red"})
    with pytest.raises(ValueError, match="min_len"):
        load_task({"type": "reverse", "min_len": 5, "max_len": 2})


def test_jsonl_text_image_path_and_uri(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "cat.png").write_bytes(b"\x89PNG fake pixels")
    lines = [
        {"prompt": "2+2=", "answer": "4"},
        {
            "prompt": [
                {"type": "text", "text": "What is this? "},
                {"type": "image", "path": "img/cat.png", "mime": "image/png"},
                {"type": "text", "text": "One word."},
            ],
            "answer": "cat",
            "task": "vision",
        },
        {"prompt": [{"type": "audio", "uri": "s3://bucket/a.wav", "mime": "audio/wav"}], "answer": 7},
    ]
    file = tmp_path / "data.jsonl"
    file.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n" + json.dumps(lines[2]) + "\n")

    items = load_task({"type": "jsonl", "path": str(file)})
    assert [i.index for i in items] == [0, 1, 2]
    assert items[0] == TaskItem(parts=(TextPart(text="2+2="),), answer="4", task="jsonl", index=0)
    image = items[1].parts[1]
    assert isinstance(image, ImagePart) and image.inline == b"\x89PNG fake pixels" and image.mime == "image/png"
    assert items[1].task == "vision" and items[1].answer == "cat"
    assert prompt_text(items[1].parts) == "What is this? One word."
    audio = items[2].parts[0]
    assert audio.ref == MediaRef(uri="s3://bucket/a.wav") and audio.inline is None
    assert items[2].answer == "7"


def test_jsonl_reports_every_bad_line(tmp_path):
    file = tmp_path / "bad.jsonl"
    file.write_text(
        "\n".join(
            [
                '{"prompt": "ok", "answer": "1"}',
                "{not json",
                '{"answer": "no prompt"}',
                '{"prompt": [{"type": "image", "path": "missing.png", "mime": "image/png"}]}',
                '{"prompt": [{"type": "smell", "text": "x"}]}',
                '{"prompt": "fine"}',
                '{"prompt": [{"type": "image", "uri": "s3://x", "mime": "not a mime"}]}',
                "[1, 2]",
            ]
        )
    )
    with pytest.raises(ValueError) as info:
        load_task({"type": "jsonl", "path": str(file)})
    msg = str(info.value)
    assert str(file) in msg and "6 bad line(s)" in msg
    for n, what in [
        (2, "not valid JSON"),
        (3, "missing 'prompt'"),
        (4, "missing.png"),
        (5, "unknown type 'smell'"),
        (7, "mime"),
        (8, "expected a JSON object"),
    ]:
        assert f"line {n}: " in msg and what in msg.split(f"line {n}: ")[1].splitlines()[0]
    assert "line 1:" not in msg and "line 6:" not in msg


def test_jsonl_caps_the_report_at_20(tmp_path):
    file = tmp_path / "many.jsonl"
    file.write_text("oops\n" * 25)
    with pytest.raises(ValueError, match=r"25 bad line\(s\)") as info:
        load_task({"type": "jsonl", "path": str(file)})
    assert "line 20:" in str(info.value) and "line 21:" not in str(info.value)
    assert "and 5 more" in str(info.value)


def test_jsonl_refuses_a_lone_surrogate_that_no_message_could_carry(tmp_path):
    file = tmp_path / "odd.jsonl"
    file.write_text('{"prompt": "ok \\u00e9\\u0000"}\n{"prompt": "a\\udcffb"}\n{"prompt": "x", "answer": "\\ud800"}\n')
    with pytest.raises(ValueError, match=r"2 bad line\(s\)") as info:
        load_task({"type": "jsonl", "path": str(file)})
    assert "line 2: holds '\\udcff', a lone surrogate" in str(info.value)
    assert "line 3: holds '\\ud800', a lone surrogate" in str(info.value)


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        load_task({"type": "jsonl", "path": str(tmp_path / "nope.jsonl")})


# --- built-in rewards ------------------------------------------------------------------------------


def score(spec, completion, answer="4", finish_reason="stop"):
    return Scorer([spec]).score(completion, answer, finish_reason)


def test_exact_needs_a_match_and_a_stop():
    assert score({"type": "exact"}, " 4\n").reward == 1.0
    assert score({"type": "exact"}, "5").reward == 0.0
    assert score({"type": "exact"}, "4", finish_reason="length").reward == 0.0
    assert score({"type": "exact"}, "4", answer=None).error == "ValueError: exact reward needs a reference answer"


def test_numeric_reads_the_first_number():
    assert score({"type": "numeric"}, "the answer is 4.0, not 5").reward == 1.0
    assert score({"type": "numeric"}, "5 or 4").reward == 0.0
    assert score({"type": "numeric"}, "no digits here").reward == 0.0
    assert score({"type": "numeric"}, "-1.5e1", answer="-15").reward == 1.0
    assert score({"type": "numeric", "options": {"tolerance": 0.1}}, "4.05").reward == 1.0
    assert score({"type": "numeric"}, "4.05").reward == 0.0


def test_format_needs_a_full_match():
    spec = {"type": "format", "options": {"pattern": r"\d+"}}
    assert score(spec, "123").reward == 1.0
    assert score(spec, "123 apples").reward == 0.0
    with pytest.raises(ValueError, match=r"bad reward .*options: Field required"):
        Scorer([{"type": "format"}])
    with pytest.raises(ValueError, match="not a regular expression"):
        Scorer([{"type": "format", "options": {"pattern": "("}}])


def test_weights_and_components_sum():
    scorer = Scorer(
        [
            {"type": "exact", "weight": 2.0},
            {"type": "format", "weight": 0.5, "options": {"pattern": r"\d"}},
            {"type": "numeric", "weight": -1.0, "name": "penalty"},
        ]
    )
    reward, components, error = scorer.score("4", "4", "stop")
    assert error is None
    assert components == {"exact": 2.0, "format": 0.5, "penalty": -1.0}
    assert reward == pytest.approx(1.5) == sum(components.values())


def test_bad_specs_fail_at_construction():
    with pytest.raises(ValueError, match=r"does not match any of the expected tags: 'exact', 'numeric'"):
        Scorer([{"type": "bleu"}])
    with pytest.raises(ValueError, match=r"options: Field required"):
        Scorer([{"type": "python"}])
    with pytest.raises(ValueError, match=r"options.function: String should match pattern"):
        Scorer([{"type": "python", "options": {"function": "no colon"}}])
    with pytest.raises(ValueError, match=r"options.tolerence: Extra inputs are not permitted"):
        Scorer([{"type": "numeric", "options": {"tolerence": 0.1}}])
    with pytest.raises(ValueError, match="several rewards named"):
        Scorer([{"type": "exact"}, {"type": "exact"}])


def test_default_rewards():
    for task in ("addition", "reverse", "jsonl"):
        assert default_rewards(task) == [ExactReward(type="exact")]
    with pytest.raises(ValueError, match="no default reward"):
        default_rewards("poetry")


# --- user code -------------------------------------------------------------------------------------


def test_user_function_good_with_options_and_components():
    specs = [
        {"type": "python", "options": {"function": f"{FNS}:good", "bonus": 0.25}},
        {"type": "python", "weight": 2.0, "options": {"function": f"{FNS}:components"}},
    ]
    with Scorer(specs) as scorer:
        reward, components, error = scorer.score("4", "4", "stop")
        assert error is None
        assert components == {"good": 1.25, "components.correct": 2.0, "components.short": 1.0}
        assert reward == pytest.approx(4.25)
        assert scorer.score("12345", "4", "stop").components["components.short"] == 0.0


def test_user_function_that_raises_scores_zero_with_the_error():
    with Scorer([{"type": "exact"}, {"type": "python", "options": {"function": f"{FNS}:raises"}}]) as scorer:
        assert scorer.score("4", "4", "stop") == (0.0, {}, "ZeroDivisionError: user code divided by zero")
        assert scorer.score("4", "4", "stop").error.startswith("ZeroDivisionError")
    with Scorer([{"type": "python", "options": {"function": f"{FNS}:not_a_number"}}]) as scorer:
        assert scorer.score("4", "4", "stop").error == (
            "TypeError: reward function returned str, expected a float or a dict of floats"
        )


def test_hung_user_function_is_abandoned_and_the_next_call_works():
    with Scorer([{"type": "python", "timeout_s": 1.0, "options": {"function": f"{FNS}:hangs"}}]) as scorer:
        (sandbox,) = scorer._sandboxes.values()
        pid = sandbox.pid
        assert scorer.score("hang", "4", "stop") == (0.0, {}, "timed out after 1s")
        assert sandbox.pid is None
        assert scorer.score("fine", "4", "stop") == (1.0, {"hangs": 1.0}, None)
        assert sandbox.pid not in (None, pid)


def test_missing_user_function_fails_clearly():
    with pytest.raises(ValueError, match=r"reward function 'no_such_module:f' cannot be imported: ModuleNotFoundError"):
        Scorer([{"type": "python", "options": {"function": "no_such_module:f"}}])
    with pytest.raises(ValueError, match=rf"'{FNS}:missing' cannot be imported: AttributeError"):
        Scorer([{"type": "python", "options": {"function": f"{FNS}:missing"}}])
    with pytest.raises(
        ValueError, match=r"'tests.workers.reward_fns:good' does not take the options \{'colour': 1\}: .*'colour'"
    ):
        Scorer([{"type": "python", "options": {"function": f"{FNS}:good", "colour": 1}}])


def test_jsonl_media_as_base64(tmp_path):
    file = tmp_path / "b64.jsonl"
    good = base64.b64encode(b"RIFF a wave").decode()
    lines = [
        {"prompt": [{"type": "audio", "base64": good, "mime": "audio/wav"}, {"type": "text", "text": "?"}]},
        {"prompt": [{"type": "image", "base64": "not base64!", "mime": "image/png"}]},
        {"prompt": [{"type": "image", "base64": good}]},
        {"prompt": [{"type": "image", "base64": good, "path": "x.png", "mime": "image/png"}]},
    ]
    file.write_text(json.dumps(lines[0]) + "\n")
    (audio, _), *_ = [it.parts for it in load_task({"type": "jsonl", "path": str(file)})]
    assert isinstance(audio, AudioPart) and audio.inline == b"RIFF a wave"
    file.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with pytest.raises(ValueError) as info:
        load_task({"type": "jsonl", "path": str(file)})
    msg = str(info.value)
    assert "3 bad line(s)" in msg
    for what in ("is not valid base64", "with 'base64' needs a 'mime'", "exactly one of 'path', 'uri' or 'base64'"):
        assert what in msg, msg

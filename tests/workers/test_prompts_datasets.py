"""Prompts as users write them (chat template, raw text, no BOS), local datasets, and the math verifier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas import ChatTurn
from workers.data.prompts import answer_ids, prompt_ids
from workers.data.tasks import epoch_order, load_task
from workers.data.tokenizer import BOS_ID, EOS_ID, build_byte_tokenizer
from workers.rewards.scorer import Scorer
from workers.rewards.verifiers import last_boxed, last_number
from workers.roles.feeder import group_for

pytestmark = pytest.mark.workers

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORD_PROBLEMS = "examples/data/word_problems.jsonl"
GSM8K = {"template": "{question}", "answer_regex": r"####\s*(.+)"}


def test_raw_prompts_start_with_the_bos_once():
    tok = build_byte_tokenizer()
    assert prompt_ids(tok, "1+2=", "raw") == [BOS_ID, *b"1+2="]
    assert prompt_ids(tok, "1+2=") == [BOS_ID, *b"1+2="], "auto is raw without a chat template"
    assert prompt_ids(tok, "x", "raw", system="Be brief.") == [BOS_ID, *b"Be brief.\n\nx"]
    assert answer_ids(tok, "3") == [*b"3", EOS_ID]


def test_a_tokenizer_without_bos_adds_none():
    tok = build_byte_tokenizer()
    tok.bos_token = None
    assert tok.bos_token_id is None
    ids = prompt_ids(tok, "1+2=", "raw")
    assert ids == list(b"1+2=") and None not in ids
    with pytest.raises(ValueError, match="renders to no tokens"):
        prompt_ids(tok, "", "raw")


def test_chat_prompts_go_through_the_template():
    tok = build_byte_tokenizer()
    tok.chat_template = TEMPLATE
    expected = "<|system|>Be brief.\n<|user|>What is 2+3?\n<|assistant|>"
    assert prompt_ids(tok, "What is 2+3?", "auto", system="Be brief.") == list(expected.encode())
    assert prompt_ids(tok, "hi", "raw") == [BOS_ID, *b"hi"], "raw ignores the template"
    plain = build_byte_tokenizer()
    with pytest.raises(ValueError, match="has no chat template"):
        prompt_ids(plain, "hi", "chat")


def test_a_conversation_renders_its_turns_before_the_prompt():
    tok = build_byte_tokenizer()
    tok.chat_template = TEMPLATE
    history = (ChatTurn(role="user", content="Hi"), ChatTurn(role="assistant", content="Hello"))
    expected = "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>Hello\n<|user|>What is 2+3?\n<|assistant|>"
    assert prompt_ids(tok, "What is 2+3?", "chat", "Be brief.", history) == list(expected.encode())
    own = (ChatTurn(role="system", content="Own."), *history)
    expected = "<|system|>Own.\n<|user|>Hi\n<|assistant|>Hello\n<|user|>Go\n<|assistant|>"
    assert prompt_ids(tok, "Go", "chat", "Be brief.", own) == list(expected.encode()), "its system turn wins"
    assert prompt_ids(tok, "Go", "raw", "S", history) == [BOS_ID, *b"S\n\nHi\n\nHello\n\nGo"]
    with pytest.raises(ValueError, match="must not end with a user turn"):
        prompt_ids(tok, "Go", "chat", None, history[:1])


def test_hf_task_reads_conversations(tmp_path):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "And 2+3?"},
        {"role": "assistant", "content": "5"},
    ]
    rows = [{"messages": chat, "answer": "5"}, {"messages": chat[:2], "answer": "2"}]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second = load_task({"type": "hf", "path": str(path), "messages_field": "messages"})
    assert first.parts[0].text == "And 2+3?" and first.answer == "5"  # type: ignore[union-attr]
    assert [(t.role, t.content) for t in first.history] == [(m["role"], m["content"]) for m in chat[:3]]
    assert second.parts[0].text == "What is 1+1?" and [t.role for t in second.history] == ["system"]  # type: ignore[union-attr]
    group = group_for("r", 2, [first], 0, 0)
    assert group.history == first.history, "the feeder carries the history to the rollout"

    bad = [
        {"messages": [{"role": "assistant", "content": "hi"}], "answer": "1"},
        {"messages": [{"role": "robot", "content": "x"}, {"role": "user"}], "answer": "1"},
        {"messages": "not a list", "answer": "1"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(ValueError) as err:
        load_task({"type": "hf", "path": str(path), "messages_field": "messages"})
    text = str(err.value)
    assert "3 bad row(s)" in text and "no user turn" in text and "turn 0 role" in text and "turn 1 content" in text


def test_epochs_after_the_first_are_reshuffled_when_the_task_is_seeded():
    items = load_task({"type": "addition", "seed": 1})
    ids = [group_for("r", 2, items, i, 0, seed=1).group_id for i in range(300)]
    epochs = [ids[:100], ids[100:200], ids[200:]]
    assert epochs[0] == [f"e0-i{item.index}" for item in items], "the first pass is the loaded order"
    rows = [[int(g.split("-i")[1]) for g in e] for e in epochs]
    assert all(sorted(r) == list(range(100)) for r in rows), "every pass covers every row once"
    assert rows[0] != rows[1] != rows[2] != rows[0], "each pass in its own order"
    assert [group_for("r", 2, items, i, 0, seed=1).group_id for i in range(100, 200)] == epochs[1], "reproducible"
    unshuffled = [group_for("r", 2, items, i, 0).group_id.split("-i")[1] for i in range(200)]
    assert unshuffled[:100] == unshuffled[100:], "no seed: the same order every pass"
    assert epoch_order(3, 0, 5) == (0, 1, 2)


def test_hf_task_reads_jsonl_parquet_and_dataset_directories(tmp_path):
    import datasets

    from_jsonl = load_task({"type": "hf", "path": WORD_PROBLEMS, **GSM8K})
    rows = [json.loads(line) for line in Path(WORD_PROBLEMS).read_text().splitlines()]
    assert len(from_jsonl) == len(rows) == 60
    assert from_jsonl[0].parts[0].text == rows[0]["question"]  # type: ignore[union-attr]
    assert from_jsonl[0].answer == rows[0]["answer"].rsplit("####", 1)[1].strip()
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(tmp_path / "wp.parquet")
    table.save_to_disk(tmp_path / "wp-dir")
    for path in (tmp_path / "wp.parquet", tmp_path / "wp-dir"):
        items = load_task({"type": "hf", "path": str(path), **GSM8K})
        assert [(i.parts, i.answer) for i in items] == [(i.parts, i.answer) for i in from_jsonl], path
    shuffled = load_task({"type": "hf", "path": WORD_PROBLEMS, **GSM8K, "seed": 1, "limit": 10})
    assert len(shuffled) == 10 and [i.index for i in shuffled] == list(range(10))
    assert {i.answer for i in shuffled} <= {i.answer for i in from_jsonl} and shuffled[0] != from_jsonl[0]


def test_hf_task_reports_every_unusable_row(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        "\n".join(json.dumps(r) for r in [{"q": "a", "answer": "1"}, {"q": "b"}, {"q": "c", "answer": "x"}])
    )
    with pytest.raises(ValueError) as err:
        load_task({"type": "hf", "path": str(path), "prompt_field": "q", "answer_regex": r"(\d+)"})
    text = str(err.value)
    assert "2 bad row(s)" in text and "row 1: field 'answer' is null" in text and "row 2: answer_regex" in text
    with pytest.raises(ValueError, match="template names field 'question'"):
        load_task({"type": "hf", "path": str(path), "template": "{question}"})
    with pytest.raises(ValueError, match="no dataset at"):
        load_task({"type": "hf", "path": str(tmp_path / "missing.parquet")})
    with pytest.raises(ValueError, match="not a dataset file"):
        (tmp_path / "x.txt").write_text("hi")
        load_task({"type": "hf", "path": str(tmp_path / "x.txt")})


MATH_CASES = [
    # completion, answer, extract, expected reward
    ("The answer is \\boxed{18}.", "18", "boxed", 1.0),
    ("The answer is 18.", "18", "boxed", 0.0),  # boxed required
    ("\\boxed{\\frac{2}{4}}", "0.5", "boxed", 1.0),
    ("\\boxed{x+1}", "1+x", "boxed", 1.0),
    ("It costs $1,250 in total.", "1250", "last_number", 1.0),
    ("First 3, then 5 apples.", "3", "last_number", 0.0),
    ("x = 0.5", "\\frac{1}{2}", "auto", 1.0),
    ("The answer is 7.", "7", "auto", 1.0),
    ("The answer is 8.", "7", "auto", 0.0),
    ("no idea", "7", "auto", 0.0),
]


def test_math_reward_on_a_table_of_cases():
    specs = [{"type": "math", "name": e, "options": {"extract": e}} for e in ("auto", "boxed", "last_number")]
    with Scorer(specs[:1]) as auto, Scorer(specs[1:2]) as boxed, Scorer(specs[2:]) as last:
        scorers = {"auto": auto, "boxed": boxed, "last_number": last}
        for completion, answer, extract, expected in MATH_CASES:
            score = scorers[extract].score(completion, answer, "stop")
            assert score.error is None, (completion, score.error)
            assert score.reward == expected, (completion, answer, extract, score)
        failed = auto.score("7", None, "stop")
        assert failed.reward == 0.0 and "needs a reference answer" in (failed.error or "")


def test_answer_extraction():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("none") is None
    assert last_number("from 3 to -4.5, then 1,000") == "1000"
    assert last_number("no digits") is None

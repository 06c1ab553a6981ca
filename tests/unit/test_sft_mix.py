"""Supervised rows mixed into RL (`trainer.sft`), the pure parts: which rows each update draws, the dataset file and
its refusals, the settings, the pre-start check and the step's summed metric."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_bus.errors import ConfigError
from workers.config import parse_config
from workers.data.sft_dataset import sft_items
from workers.preflight import preflight
from workers.role_registry import role_def
from workers.training.sft_mix import rows_of_update
from workers.training.step_metrics import StepSums

pytestmark = pytest.mark.unit


def test_each_pass_trains_every_row_once_and_the_updates_continue_the_order():
    count, batch = 7, 3
    drawn = [r for u in range(7) for r in rows_of_update(u, batch, count, seed=5)]  # 21 rows: three whole passes
    passes = [drawn[k : k + count] for k in range(0, len(drawn), count)]
    assert all(sorted(p) == list(range(count)) for p in passes)
    assert len({tuple(p) for p in passes}) == 3  # each pass its own permutation
    assert rows_of_update(4, batch, count, seed=5) == drawn[12:15]  # from the update count alone: no state
    assert rows_of_update(0, 10, 4, seed=5)[4:8] == rows_of_update(1, 4, 4, seed=5)  # the position alone decides
    assert rows_of_update(0, 7, 7, seed=6) != passes[0]  # the seed picks the order


def test_a_batch_larger_than_the_dataset_spans_passes():
    rows = rows_of_update(0, 9, 2, seed=0)
    assert len(rows) == 9 and all(sorted(rows[k : k + 2]) == [0, 1] for k in range(0, 8, 2))


def write(tmp_path: Path, lines: list[object]) -> Path:
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_examples_come_as_prompt_and_answer_or_as_a_conversation(tmp_path):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+4="},
        {"role": "assistant", "content": "7"},
    ]
    items = sft_items(write(tmp_path, [{"prompt": "1+1=", "answer": 2}, "", {"messages": chat}]))
    assert [(i.parts[0].text, i.answer, i.index) for i in items] == [("1+1=", "2", 0), ("3+4=", "7", 1)]
    assert [(t.role, t.content) for t in items[1].history] == [
        ("system", "Be brief."),
        ("user", "2+2="),
        ("assistant", "4"),
    ]
    assert items[0].history == ()


def test_every_bad_line_is_listed_with_its_number(tmp_path):
    lines = [
        {"prompt": "1+1="},
        "{not json",
        {"prompt": "1+1=", "answer": "2", "messages": []},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]},
        {"messages": [{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "user", "content": "b"},
                {"role": "assistant", "content": "c"},
            ]
        },
        {"prompt": "2+2=", "answer": "4"},
    ]
    with pytest.raises(ValueError) as err:
        sft_items(write(tmp_path, lines))
    message = str(err.value)
    assert message.startswith(f"sft dataset {tmp_path / 'sft.jsonl'}: 7 bad line(s):")
    for n, what in [
        (1, "no 'answer' to train on"),
        (2, "not valid JSON"),
        (3, "give either 'messages' or 'prompt' and 'answer', not both"),
        (4, "the last message must be the assistant's answer"),
        (5, "the answer must follow a user message, not a 'assistant' one"),
        (6, "messages[0] role:"),
        (7, "two user messages in a row"),
    ]:
        assert f"line {n}: {what}" in message, (n, message)
    assert "line 8" not in message


def test_a_missing_or_empty_file_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^sft dataset '.*gone.jsonl' cannot be read: No such file") as err:
        sft_items(tmp_path / "gone.jsonl")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"sft\.jsonl: no examples \(the file has no non-blank line\)$"):
        sft_items(write(tmp_path, ["", "  "]))


def test_sft_is_off_by_default_and_its_bad_settings_are_refused():
    assert parse_config({"run": "r"}).trainer.sft is None
    on = parse_config({"run": "r", "trainer": {"sft": {"dataset": "d.jsonl"}}}).trainer.sft
    assert on is not None and (on.coef, on.batch_size, on.seed) == (0.1, 8, 0)
    with pytest.raises(ConfigError) as err:
        parse_config({"run": "r", "trainer": {"sft": {"dataset": "d.jsonl", "coef": 0, "batch_size": 0}}})
    problems = err.value.problems
    assert len(problems) == 2 and all("\n" not in p for p in problems), problems
    assert any("trainer.sft.coef" in p and "greater than 0" in p for p in problems), problems
    assert any("trainer.sft.batch_size" in p for p in problems), problems
    with pytest.raises(ConfigError) as err:
        parse_config({"run": "r", "trainer": {"sft": {"coef": 0.5}}})
    assert any("trainer.sft.dataset" in p for p in err.value.problems), err.value.problems


def test_the_actors_pre_start_check_refuses_a_missing_dataset(tmp_path):
    config = parse_config({"run": "pf", "trainer": {"sft": {"dataset": str(tmp_path / "gone.jsonl")}}})
    assert "sft" in role_def("actor").checks
    with pytest.raises(ConfigError) as err:
        preflight(config, tmp_path, ("task", "sft"))
    assert err.value.problems == [
        f"trainer.sft.dataset: sft dataset '{tmp_path / 'gone.jsonl'}' cannot be read: No such file or directory"
    ]
    preflight(parse_config({"run": "pf"}), tmp_path, ("sft",))  # off: nothing to check


def test_the_steps_sft_seconds_are_summed_over_its_updates_and_its_loss_averaged():
    sums = StepSums()
    sums.add({"sft_loss": 2.0, "sft_s": 0.5, "loss": 1.0})
    sums.add({"sft_loss": 4.0, "sft_s": 0.25, "loss": 3.0})
    assert sums.means(2) == {"sft_loss": 3.0, "sft_s": 0.75, "loss": 2.0}

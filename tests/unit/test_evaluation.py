"""Held-out evaluation and progress as numbers: the `eval/*` values, the held-out split of the demo's task, the
`eval` section's checks, the ETA of the progress line, and the curve's evaluation markers."""

from __future__ import annotations

import io
import json

import pytest

from relax_bus.errors import ConfigError
from schemas import RunEvent
from workers.config import load_config, parse_config, task_spec
from workers.data.tasks import load_task
from workers.launch.curve import draw_curve, eval_rows, eval_series
from workers.launch.progress import Progress, clock, eta_s
from workers.metrics.evaluation import eval_line, eval_numbers, eval_values, eval_version
from workers.preflight import preflight
from workers.roles.evaluation import eval_block, eval_items

pytestmark = pytest.mark.unit


def test_eval_values_of_greedy_and_sampled_rewards():
    greedy = [1.0, 0.0, 0.0, 1.0]  # [items]
    sampled = [[1.0, 1.0, 0.0], [0.0, 0.5, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]  # [items, k=3]
    values = eval_values(greedy, sampled, correct_at=1.0)
    assert values == pytest.approx(
        {
            "eval/greedy_accuracy": 0.5,
            "eval/greedy_reward": 0.5,
            "eval/reward_mean": 3.5 / 12,
            "eval/accuracy": 3 / 12,
            "eval/pass_at_k": 0.5,  # items 0 and 1 have a correct sample; 3 is right greedily only
            "eval/k": 3.0,
            "eval/items": 4.0,
        }
    )
    RunEvent(run="r", event="eval", fields=values)  # every name is a valid event field name (no `@`)
    assert eval_values(greedy, sampled, correct_at=0.5)["eval/pass_at_k"] == 0.5
    assert eval_values([0.4], [[0.6]], correct_at=0.5)["eval/greedy_accuracy"] == 0.0
    for bad in (([], []), ([1.0], [[1.0], [1.0]]), ([1.0, 1.0], [[1.0], [1.0, 0.0]]), ([1.0], [[]])):
        with pytest.raises(ValueError):
            eval_values(*bad, correct_at=1.0)


def test_eval_event_fields_read_back():
    fields = {"eval/version": 10, "eval/pass_at_k": 0.75, "eval/k": 4, "eval/greedy_accuracy": 0.5, "note": "x",
              "eval/flag": True}  # fmt: skip
    assert eval_version(fields) == 10
    numbers = {"eval/version": 10, "eval/pass_at_k": 0.75, "eval/k": 4, "eval/greedy_accuracy": 0.5}
    assert eval_numbers(fields) == numbers
    assert RunEvent(run="r", event="eval", fields=fields).fields == fields  # every name is a valid field name
    for version in (None, -1, 2.5, True, "3"):
        assert eval_version({"eval/version": version}) is None
    line = eval_line({**eval_numbers(fields), "eval/reward_mean": 0.25, "eval/items": 20.0})
    assert line == "eval v10: greedy 0.500  pass@4 0.750  reward 0.250 (20 items)"


def test_eval_blocks():
    assert [eval_block(v, 10) for v in (0, 9, 10, 19, 20, 105)] == [0, 0, 1, 1, 2, 10]
    assert [eval_block(v, 1) for v in range(4)] == [0, 1, 2, 3]


def test_addition_offset_holds_out_what_the_limit_leaves():
    train = load_task({"type": "addition", "seed": 0, "limit": 80})
    held = load_task({"type": "addition", "seed": 0, "offset": 80})
    everything = load_task({"type": "addition", "seed": 0})
    prompts = [i.parts for i in train], [i.parts for i in held]
    assert len(held) == 20 and not set(prompts[0]) & set(prompts[1])
    assert prompts[0] + prompts[1] == [i.parts for i in everything]
    assert [i.parts for i in load_task({"type": "addition", "seed": 0, "offset": 10, "limit": 5})] == [
        i.parts for i in everything[10:15]
    ]
    with pytest.raises(ValueError, match="offset 100 skips every one"):
        load_task({"type": "addition", "offset": 100})


def test_the_demo_evaluates_a_set_it_never_trains_on():
    config = load_config("examples/demo.yaml")
    assert config.eval is not None and config.eval.every == 10
    train = {i.parts for i in load_task(task_spec(config.task))}
    held = eval_items(config.eval)
    assert held and not train & {i.parts for i in held}
    assert {i.answer for i in held} <= {str(n) for n in range(19)}


def test_the_eval_section_is_checked_against_the_run():
    held = {"type": "addition", "options": {"seed": 0, "offset": 80}}
    assert parse_config({"run": "e", "eval": {"dataset": held}}).eval is not None
    with pytest.raises(ConfigError, match="must be of the training task's type"):
        parse_config({"run": "e", "task": {"type": "reverse"}, "eval": {"dataset": held}})
    with pytest.raises(ConfigError, match=r"eval\.every"):
        parse_config({"run": "e", "eval": {"dataset": held, "every": 0}})
    with pytest.raises(ConfigError, match=r"eval\.dataset"):
        parse_config({"run": "e", "eval": {"every": 5}})


def test_eta_from_the_rate_since_the_first_step():
    # First seen: step 1 at t=100; step 11 at t=120: 0.5 steps/s, 89 steps left -> 178 s.
    assert eta_s(11, 100, 1, 100.0, 120.0) == pytest.approx(178.0)
    assert eta_s(1, 100, 1, 100.0, 120.0) is None  # no rate from one step
    assert eta_s(5, 100, 1, 100.0, 100.0) is None  # no time passed
    assert eta_s(100, 100, 1, 100.0, 150.0) == 0.0
    # A resumed run: first seen at step 50 counts from there.
    assert eta_s(60, 100, 50, 0.0, 20.0) == pytest.approx(80.0)
    assert [clock(s) for s in (0, 42.4, 65, 3599, 3720)] == ["0s", "42s", "1m05s", "59m59s", "1h02m"]


def test_the_progress_line_shows_the_eta_and_the_stages():
    out = io.StringIO()
    progress = Progress(100, out, every=1)
    progress.stage("rollout", "loading model")
    progress.update(1, {"reward_mean": 0.5}, {})
    progress.update(2, {"reward_mean": 0.5}, {})
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("] rollout: loading model"), lines
    assert lines[1].endswith("ETA -"), lines  # one step: no rate yet
    assert "steps/min  ETA " in lines[2] and not lines[2].endswith("ETA -"), lines


def test_the_curve_marks_the_evaluations(tmp_path):
    steps = [{"step": s, "wall_s": float(s), "reward_mean": s / 10} for s in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    evals = [{"eval/version": v, "eval/greedy_accuracy": v / 20, "eval/pass_at_k": 0.5, "at": 1.0} for v in (5, 0)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals) + '{"torn')
    rows = eval_rows(tmp_path / "eval.jsonl")
    assert [r["eval/version"] for r in rows] == [0, 5]
    assert [name for name, _, _ in eval_series(rows)] == ["eval/greedy_accuracy", "eval/pass_at_k"]
    assert draw_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png") == tmp_path / "curve.png"
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_the_pre_start_check_loads_the_held_out_set(tmp_path):
    held = {"type": "jsonl", "options": {"path": str(tmp_path / "held-out.jsonl")}}
    train = {"type": "jsonl", "options": {"path": str(tmp_path / "train.jsonl")}}
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    config = parse_config({"run": "pf", "task": train, "eval": {"dataset": held}})
    with pytest.raises(ConfigError, match=r"held-out\.jsonl"):
        preflight(config, tmp_path, ("task",))
    (tmp_path / "held-out.jsonl").write_text('{"prompt": "2+2=", "answer": "4"}\n')
    preflight(config, tmp_path, ("task",))

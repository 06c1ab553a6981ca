"""`relax model warmup` and `relax model judge-train` as a user runs them: a model directory another run can name
(`teacher.source`, `judge.source`), the progress lines, and one-line refusals."""

from __future__ import annotations

import json
import re

import pytest

from tests.cli.test_cli import relax
from workers.config import load_config
from workers.data.tasks import load_task, prompt_text
from workers.preflight import preflight

pytestmark = [pytest.mark.cli, pytest.mark.timeout(420)]

SHORT = ("model.source=tiny:64x2", "trainer.warmup.check_every=2")


def test_warmup_writes_a_model_directory_a_teacher_can_name(tmp_path):
    out = tmp_path / "teacher"
    done = relax(
        "model",
        "warmup",
        "examples/demo.yaml",
        *SHORT,
        "trainer.warmup.max_steps=4",
        "trainer.warmup.noise_steps=1",
        "--out",
        str(out),
        timeout=360,  # ~40 s idle; over 2 min on a loaded 2-core machine
    )
    assert done.returncode == 0, done.stderr
    assert "warm-up step 2/4: sampled accuracy" in done.stdout and f"model directory: {out}" in done.stdout
    record = json.loads((out / "relax_source.json").read_text())
    assert record["source"] == "warmup" and record["base"] == "tiny:64x2"
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    # Another run names it as its teacher: the pre-start check builds the policy and compares the tokenizers.
    config = load_config("examples/distill.yaml", {"teacher.source": str(out), "model.source": "tiny:64x2"})
    preflight(config, tmp_path / "work", ["model", "teacher"])
    again = relax("model", "warmup", "examples/demo.yaml", *SHORT, "--out", str(out))
    assert again.returncode == 2 and again.stderr.strip() == f"relax: error: {out} is not empty", again.stderr


def test_judge_train_writes_a_judge_and_refuses_bad_data_in_one_line(tmp_path):
    out = tmp_path / "judge"
    judge_train = ("model", "judge-train", "examples/judge.yaml", *SHORT)
    done = relax(*judge_train, "--task-pairs", "--steps", "4", "--out", str(out), timeout=360)
    assert done.returncode == 0, done.stderr
    assert (
        "judge step 4/4: loss" in done.stdout
        and f"judge directory: {out} (from tiny:64x2; 500 pairs from task addition" in done.stdout
    )
    record = json.loads((out / "relax_source.json").read_text())
    assert record["source"] == "judge-train" and record["pairs"] == 500 and 0.0 <= record["agreement"] <= 1.0
    config = load_config("examples/judge.yaml", {"judge.source": str(out), "model.source": "tiny:64x2"})
    preflight(config, tmp_path / "work", ["task", "judge"])
    # Retrained on what a run logged: by default from the run's judge (judge.source), labelled by the rule.
    log = tmp_path / "samples.jsonl"
    items = [(prompt_text(i.parts), i.answer) for i in load_task({"type": "addition", "seed": 0})[:20]]
    rows = [{"prompt": q, "response": a if k % 2 else a + "1", "verdict": 1.0} for k, (q, a) in enumerate(items)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    again = tmp_path / "judge-again"
    retrained = relax(
        *judge_train, f"judge.source={out}", "--samples", str(log), "--steps", "2", "--out", str(again), timeout=360
    )
    assert retrained.returncode == 0, retrained.stderr
    said = re.search(
        rf"judge directory: {re.escape(str(again))} \(from the run's judge \({re.escape(str(out))}\); (\d+) pairs "
        rf"from the samples of {re.escape(str(log))}, labelled by the rule \(20 distinct of 20 logged; 0 skipped: "
        r"failed, clipped or not items of the task; the run's judge said yes to 10 of 10 wrong ones\), with (\d+) "
        r"contrasts of its 30 commonest responses",
        retrained.stdout,
    )
    assert said and int(said[1]) == 20 + int(said[2]) > 20, retrained.stdout
    assert json.loads((again / "relax_source.json").read_text())["steps"] == 2
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "1+1=", "response": "2"}\n')
    refused = relax("model", "judge-train", "examples/judge.yaml", "--data", str(bad), "--out", str(tmp_path / "j2"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"{bad}:1: not a labelled pair" in refused.stderr


def test_judge_train_samples_the_policy_along_its_warm_up_and_refuses_samples_all_wrong(tmp_path):
    warmup = ("trainer.warmup.max_steps=4", "trainer.warmup.noise_steps=1")
    out = tmp_path / "judge"
    args = ("model", "judge-train", "examples/judge.yaml", *SHORT, *warmup, "--contrasts", "0", "--out", str(out))
    done = relax(*args, timeout=300)
    # The policy is sampled before its warm-up, at its checks (steps 2 and 4) and at its end: 4 x 100 items x 2. Four
    # warm-up steps leave it wrong on every item, and without contrasts (whose reference answers are right) a judge
    # has no right pair to learn from: refused in one line.
    assert "judge data round 1 (before the warm-up): 200 samples, rule accuracy 0.000" in done.stdout
    assert "judge data round 2 (warm-up step 2): 200 samples" in done.stdout
    assert "judge data round 4 (at the warm-up's end): 200 samples" in done.stdout
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "the labelled pairs must hold right and wrong ones" in done.stderr and not out.exists()

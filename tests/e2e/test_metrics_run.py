"""`relax run` with the metrics role, by default: the run directory gets TensorBoard event files and an
offline W&B run with the reward of every step, next to the metrics.jsonl and summary.json it has always
had, and the run serves Prometheus gauges on the port it prints. Each step carries its reward's terms, its
responses' lengths and truncation and the policy's namespaced figures, and a few samples go to samples.jsonl
(clipped), TensorBoard text and a W&B table. A held-out set is evaluated every 2 policy versions (`eval/*` in
eval.jsonl, TensorBoard and W&B, a line each on the terminal), the roles' start-up stages are printed before the first
step, and the progress line ends with the steps' rate and the time left."""

from __future__ import annotations

import json
import re
import time
import urllib.error

import pytest

from tests.chaos.test_relax_run import RelaxRun
from tests.workers.test_metrics_sinks import (
    sample_of,
    tensorboard_series,
    tensorboard_texts,
    wandb_history_when,
    wandb_points_when,
    wandb_run_record,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def _follow_prometheus(run: RelaxRun, timeout_s: float = 240) -> list[float | None]:
    """relax_step as scraped from the address `relax run` printed, until the run ends or shows every step."""
    deadline = time.monotonic() + timeout_s
    while not (found := re.search(r"Prometheus (http://\S+/metrics)", run.output)):
        assert run.proc.poll() is None and time.monotonic() < deadline, f"no Prometheus address:\n{run.output}"
        time.sleep(0.1)
    seen: list[float | None] = []
    while (
        run.proc.poll() is None and time.monotonic() < deadline and (not seen or seen[-1] != run.config.trainer.steps)
    ):
        try:
            seen.append(sample_of(found.group(1), "relax_step", run.config.run))
        except (urllib.error.URLError, ConnectionError):
            pass  # the role is not listening yet (or any more)
        time.sleep(0.1)  # scrape interval
    return seen


NEW_KEYS = (
    "reward/exact/mean",
    "reward/any/mean",
    "reward/error_rate",
    "response/length_mean",
    "response/length_max",
    "response/truncated_fraction",
    "policy/neg_logprob_mean",
    "policy/clip_fraction",
)
"""What each step of this run reports beside the existing names: two reward terms (`exact`, `any`)."""
TERMS = [{"type": "exact"}, {"type": "format", "name": "any", "weight": 0.5, "options": {"pattern": "(?s).*"}}]
"""The tiny model's answers are seldom exact: `any` (every response, weight 0.5) makes every reward at least 0.5."""
HELD_OUT = {"dataset": {"type": "addition", "options": {"seed": 1, "offset": 90}}, "every": 2, "samples": 2}
"""The last 10 sums of the task's shuffle, which trains on the first 90."""
STAGES = (
    "actor: loading model",
    "rollout: loading model",
    "rollout: generating the first groups",
    "actor: training step 1",
)


def test_relax_run_writes_tensorboard_wandb_and_serves_prometheus_by_default(tmp_path):
    samples = {"samples_per_step": 3, "sample_text_bytes": 16}
    task = {"options": {"limit": 90}}
    run = RelaxRun(tmp_path, trainer={"steps": 6}, rewards=TERMS, metrics=samples, task=task, eval=HELD_OUT)
    try:
        seen = _follow_prometheus(run)
        code = run.wait_exit(timeout_s=360)
    finally:
        run.stop()
    assert code == 0, run.output
    assert "metrics-0 (pid" in run.output, run.output
    steps = list(range(1, 7))
    lines = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == steps
    series = tensorboard_series(run.run_dir / "tensorboard", "reward_mean")
    assert [s for s, _ in series] == steps
    assert [r for _, r in series] == pytest.approx([line["reward_mean"] for line in lines])
    assert [s for s, _ in wandb_points_when(run.run_dir / "wandb", len(steps))] == steps
    # The gauge moved while the run went on: scraped before a step (or at a lower one) and at a later one.
    values = [v for v in seen if v is not None]
    assert values and max(values) >= 1 and len(set(seen)) >= 2, seen
    for line in lines:
        assert all(key in line for key in NEW_KEYS), sorted(line)
        assert line["policy/clip_fraction"] == line["ppo_clip_frac"] and line["reward/error_rate"] == 0.0
        assert line["reward/any/mean"] == 0.5, line
        terms = line["reward/exact/mean"] + line["reward/any/mean"]
        assert terms == pytest.approx(line["reward_mean"]), line  # the terms add up to the reward
        assert 1 <= line["response/length_mean"] <= line["response/length_max"] <= 3  # rollout.max_new_tokens
    logged = [json.loads(line) for line in (run.run_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [entry["step"] for entry in logged] == [s for s in steps for _ in range(3)]  # 3 a step, each step once
    for entry in logged:
        assert len(entry["prompt"].encode()) <= 16 and len(entry["response"].encode()) <= 16, entry
        assert set(entry["terms"]) == {"exact", "any"} and entry["reward"] == pytest.approx(
            sum(entry["terms"].values())
        )
    assert [len({e["group_id"] for e in logged if e["step"] == s}) for s in steps] == [3] * 6  # one per group
    assert [s for s, _ in tensorboard_texts(run.run_dir / "tensorboard", "samples")] == steps
    history = [h for h in wandb_history_when(run.run_dir / "wandb", len(steps)) if "reward_mean" in h]
    assert [h["samples/nrows"] for h in history] == [3] * 6
    _check_eval(run)
    (record, *_) = wandb_run_record(run.run_dir / "wandb")
    stored = {u.key: json.loads(u.value_json) for u in record.run.config.update}
    assert stored["eval"] == run.config.model_dump(mode="json")["eval"] and stored["run"] == run.config.run
    assert re.fullmatch(rf"{run.config.run}-[0-9a-f]{{8}}", record.run.run_id), record.run.run_id
    for stage in STAGES:  # printed before the first step's line
        assert re.search(rf"\] {stage}.*\n(.*\n)*.*step 1/6", run.output), run.output
    assert re.search(r"step 6/6 .* steps/min  ETA 0s", run.output), run.output
    assert (run.run_dir / "reward_curve.png").stat().st_size > 0
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["metrics"] == str((run.run_dir / "metrics.jsonl").resolve()), summary


def _check_eval(run: RelaxRun) -> None:
    """eval.jsonl holds each evaluated version once, at most one per block of 2 versions, v0 first (the first batch
    is generated with v0, and the rollout evaluates before its next one); the terminal and the summary show them."""
    rows = [json.loads(line) for line in (run.run_dir / "eval.jsonl").read_text().splitlines()]
    versions = [int(r["eval/version"]) for r in rows]
    assert versions and versions[0] == 0 and versions == sorted(set(versions)), versions
    assert len({v // 2 for v in versions}) == len(versions), versions  # one per block
    for row in rows:
        assert row["eval/items"] == 10 and 0 <= row["eval/greedy_accuracy"] <= row["eval/greedy_reward"] <= 1.5
        assert 0.5 <= row["eval/reward_mean"] <= 1.5, row  # the `any` term gives every answer 0.5
        assert row["eval/accuracy"] <= row["eval/pass_at_k"] <= 1, row
    series = sorted(tensorboard_series(run.run_dir / "tensorboard" / "eval", "eval/pass_at_k"))
    assert [s for s, _ in series] == versions
    shown = re.findall(r"^eval v(\d+): greedy [0-9.]+  pass@2 [0-9.]+  reward [0-9.]+ \(10 items\)$", run.output, re.M)
    assert [int(v) for v in shown] == versions, run.output
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["eval"]["evaluations"] == len(versions) and summary["eval"]["first"]["eval/version"] == 0

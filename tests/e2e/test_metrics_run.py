"""`relax run` with the metrics role, by default: the run directory gets TensorBoard event files and an
offline W&B run with the reward of every step, next to the metrics.jsonl and summary.json it has always
had, and the run serves Prometheus gauges on the port it prints."""

from __future__ import annotations

import json
import re
import time
import urllib.error

import pytest

from tests.chaos.test_relax_run import RelaxRun
from tests.workers.test_metrics_sinks import sample_of, tensorboard_series, wandb_points_when

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


def test_relax_run_writes_tensorboard_wandb_and_serves_prometheus_by_default(tmp_path):
    run = RelaxRun(tmp_path, trainer={"steps": 6})
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
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["metrics"] == str((run.run_dir / "metrics.jsonl").resolve()), summary

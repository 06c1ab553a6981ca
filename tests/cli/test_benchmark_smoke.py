"""The R3 benchmark runs end to end at a tiny size and writes the JSON its tables come from (a benchmark that
breaks at start otherwise goes unseen until someone measures again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cli
ROOT = Path(__file__).resolve().parents[2]


def test_r3_benchmark_measures_overhead_and_mismatch_at_a_tiny_size(tmp_path):
    out = tmp_path / "r3.json"
    args = ["--parts", "overhead,mismatch", "--prompts", "2", "--samples", "2", "--repeat", "1"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "r3.py"), *args, "--work-dir", str(tmp_path), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| rollout generate |" in result.stdout and "| router +1% noise (simulated) |" in result.stdout
    data = json.loads(out.read_text())
    assert data["trainer"]["step_ms_off"] > 0 and data["rollout"]["routing_bytes_per_response_token"] > 0
    simulated = [r for r in data["mismatch"] if "simulated" in r["case"]]
    assert len(simulated) == 3 and all(0 <= r["routing_agreement"] <= 1 for r in simulated)
    assert data["reward"] is None  # not asked for, and no earlier result at that path


def test_weights_stream_benchmark_takes_its_streamed_case_from_the_followed_upload(tmp_path):
    out = tmp_path / "stream.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "weights_stream.py"),
            "--sizes",
            "5",
            "--repeat",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "after / streamed latency" in result.stdout
    row = json.loads(out.read_text())["rows"][0]
    assert set(row["cases"]) == {"after", "streamed"} and row["streamed_fetches"] == 1  # not a plain fetch twice

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


@pytest.mark.timeout(300)  # ~35 s of CPU in all; a loaded 2-core machine stretches the roles' start-up
def test_gpu_run_dry_run_goes_through_relax_run_and_reports_against_plain_loops(tmp_path):
    # The CPU dry run of the one-GPU benchmark: a tiny model of a real vocabulary's kind, the plain loops, then
    # the real `relax run` (embedded nats-server, every role a process) and the report read from metrics.jsonl.
    out, work = tmp_path / "gpu_run.json", tmp_path / "work"
    args = ["--device", "cpu", "--work-dir", str(work), "--out", str(out), "--bundle", str(tmp_path / "no-bundle")]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_run.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained tokens/s (train_s)" in result.stdout and "bus s per step" in result.stdout
    data = json.loads(out.read_text())
    assert data["shape"] == "tiny" and data["batch"]["steps"] == 2
    assert [r["step"] for r in data["records"]] == [1.0, 2.0]  # the run's own metrics.jsonl, every step
    run = data["run"]
    assert run["train_s"] > 0 and run["step_s"] >= run["train_s"] and 0 <= run["bus_share"] < 1
    assert run["trained_tokens_per_s"] > 0 and run["engine_tokens_per_s"] > 0
    assert data["plain_train"]["tokens_per_s"] > 0 and data["plain_generate"]["tokens_per_s"] > 0
    assert data["run_peak_gpu_gib"] is None  # no GPU: nothing polled
    assert "NATS nats://127.0.0.1:" in (work / "run.log").read_text()  # the launcher's embedded server
    assert {p.name for p in (work / "run" / "logs").glob("*.log")} >= {"actor-0.log", "rollout-0.log"}


def test_gpu_run_tokenizer_spans_the_model_vocabulary_and_reads_text_as_bytes():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_run import wide_byte_tokenizer
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    tok = wide_byte_tokenizer(151936)  # Qwen2.5's vocabulary
    assert len(tok) == 151936
    assert tok.encode("héllo") == list("héllo".encode())  # one token per byte, no merges
    assert tok.decode([259 + ord("h") + 256 * ord("i")]) == "hi" and tok.decode([258]) == "<eos>"  # two-byte ids
    assert len(set(tok.convert_ids_to_tokens(list(range(151936))))) == 151936  # every id its own byte string

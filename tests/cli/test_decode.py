"""`relax decode` prints strict JSON (RFC 8259) whatever floats a message holds: NaN and infinities as null."""

import base64
import json
import math
import subprocess
import sys
from typing import Any

import msgpack
import pytest

from schemas import Metric, RunEvent, encode
from tests.cli.test_cli import ROOT

pytestmark = pytest.mark.cli


def decode(*args: str, stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", "decode", *args], input=stdin, capture_output=True, timeout=60, cwd=ROOT
    )


def strict_json(text: bytes) -> Any:
    """`text` parsed as RFC 8259 JSON: Python's reader takes the bare NaN, Infinity and -Infinity that `jq` and
    `JSON.parse` refuse; here they fail."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"not JSON: a bare {constant} in {text!r}")

    return json.loads(text, parse_constant=refuse)


def test_nan_in_a_message_is_printed_as_null():
    event = RunEvent(run="dec", event="warmup_done", fields={"warmup_steps": 0.0, "warmup_accuracy": math.nan})
    metric = Metric(run="dec", step=3, values={"reward_mean": math.nan, "loss": 0.5})
    out = decode(stdin=encode(event))
    assert out.returncode == 0 and not out.stderr, out
    assert strict_json(out.stdout)["fields"] == {"warmup_steps": 0.0, "warmup_accuracy": None}
    out = decode("--compact", stdin=encode(metric))
    assert out.returncode == 0 and not out.stderr, out
    assert strict_json(out.stdout)["values"] == {"reward_mean": None, "loss": 0.5}


def test_infinities_of_a_map_the_bus_refuses_are_null_too():
    # The schema refuses infinite metric values, so this map is shown raw, with the reason as a warning (exit 1).
    raw = msgpack.packb({"kind": "metric", "run": "dec", "step": 1, "values": {"up": math.inf, "down": -math.inf}})
    nan = encode(Metric(run="dec", step=2, values={"reward_mean": math.nan}))
    out = decode("--lines", stdin=base64.b64encode(raw) + b"\n" + base64.b64encode(nan) + b"\n")
    assert out.returncode == 1 and b"relax: warning: line 1: " in out.stderr, out
    first, second = (strict_json(line) for line in out.stdout.splitlines())
    assert first["values"] == {"up": None, "down": None}
    assert second["values"] == {"reward_mean": None}

"""Chaos from the first second of a `relax run` whose supervised warm-up lasts about a minute: a random role is
SIGKILLed every two seconds for the first minute. No RL step is trained meanwhile, so before the crash-loop rule
told kills from outside apart, `relax run` gave up ("6th failure within 120s without the run making progress").
Now the run completes, every released group is trained once or dropped with a reason, and no role start ended
in a traceback (the role logs are read)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from tests.chaos.test_relax_run import RelaxRun

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

KILL_EVERY_S = 2.0
KILLING_FOR_S = 60.0
WARMUP = {"max_steps": 2400, "check_every": 400, "batch_size": 64, "lr": 1e-6, "target_accuracy": 1.0}
"""About a minute of supervised steps on the tiny model (25 ms each here); the tiny learning rate keeps the
sampled accuracy from reaching the target early."""


def running_role(pid: int, label: str) -> bool:
    """Whether `pid` is still the live `relax worker` process of `label` (not reaped, not reused)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state != "Z" and b"worker" in cmdline and label.rsplit("-", 1)[0].encode() in cmdline


async def test_sigkills_of_random_roles_during_a_minute_of_warm_up(tmp_path):
    seed = int(os.environ.get("RELAX_CHAOS_SEED", "7"))
    rng = random.Random(seed)
    run = RelaxRun(tmp_path, trainer={"steps": 6, "checkpoint": {"every": 2}, "warmup": WARMUP})
    kills: list[str] = []
    try:
        await run.wait_line("started ", 0, timeout_s=120)
        labels = re.findall(r"(\w+-\d+) \(pid \d+\)", next(line for line in run.lines if line.startswith("started ")))
        started = time.monotonic()
        while time.monotonic() - started < KILLING_FOR_S:
            assert run.proc.poll() is None, f"relax run exited with {run.proc.returncode}:\n{run.output}"
            for label in rng.sample(labels, len(labels)):  # the first one of a random order that is up
                pid = run.pid_of(label)
                if running_role(pid, label):
                    os.kill(pid, signal.SIGKILL)
                    kills.append(label)
                    break
            await asyncio.sleep(KILL_EVERY_S)
        steps_while_killing = run.steps()
        assert run.wait_exit(timeout_s=420) == 0, run.output
    finally:
        run.stop()
    out = run.output
    assert "Traceback" not in out and "without the run making progress" not in out, out
    outside = re.findall(r"(\w+-\d+) was killed by SIGKILL \(from outside", out)
    assert len(outside) >= len(kills) - 2, (kills, out)  # a kill as the run ends may go unreported
    assert max(kills.count(label) for label in set(kills)) > 5, f"some role killed more than 5 times: {kills}"
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["steps"] == 6, summary
    for log in sorted((run.run_dir / "logs").glob("*.log")):
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, f"{log.name} holds a traceback:\n{text[-4000:]}"
    await run.check_exactly_once(tmp_path)
    warmups = [line for line in out.splitlines() if line.startswith("warm-up:")]
    assert warmups, out
    print(f"kills: {len(kills)} {dict((label, kills.count(label)) for label in sorted(set(kills)))}")
    print(f"steps while killing {steps_while_killing}; wall {summary['wall_s']}s; restarts {summary['restarts']}")
    print(warmups[-1])

"""Resume by re-running: `relax run CONFIG --run-dir DIR` again on the directory of a run that crashed.

The first run is cut off as a power cut would: `relax run` and every process it reported (its nats-server, each
role) SIGKILLed by PID once the actor has checkpointed a step past 0. The same command again finds the same config
(the Prometheus port it picks anew is never stored), says in one line from which checkpoint it resumes, and trains
only the steps after it: every group trained exactly once over both launches, each step once in metrics.jsonl,
and every role's log events carry the run, the role and the worker id."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from tests.chaos.test_relax_run import RelaxRun
from tests.e2e.cluster import log_events
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

STEPS = 12


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


async def crash(run: RelaxRun) -> None:
    """SIGKILL `relax run` (so that it restarts nothing), then every process it reported starting, by PID."""
    started = [int(pid) for pid in re.findall(r"\bpid (\d+)", run.output)]
    assert started, run.output
    run.proc.kill()
    run.wait_exit(timeout_s=30)
    for pid in started:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    await until(lambda: [p for p in started if _alive(p)], lambda alive: not alive, 30, "every process gone")


async def test_relax_run_again_resumes_a_crashed_run_from_its_checkpoint_and_trains_each_group_once(tmp_path):
    first = RelaxRun(tmp_path, trainer={"steps": STEPS, "checkpoint": {"every": 2}, "warmup": {"max_steps": 0}})
    actor_log = first.run_dir / "logs" / "actor-0.log"
    try:
        await until(
            lambda: [e["step"] for e in log_events(actor_log) if e["event"] == "checkpoint_saved"],
            lambda steps: any(s >= 2 for s in steps),
            240,
            "a checkpoint past step 0",
        )
        await crash(first)
    finally:
        first.stop()
    assert "resuming" not in first.output, first.output

    second = first.again()
    try:
        code = second.wait_exit(timeout_s=300)
    finally:
        second.stop()
    assert code == 0, second.output
    [line] = [line for line in second.lines if "resuming from its checkpoint" in line]
    found = re.search(r"checkpoint of step (\d+) \(of (\d+)\)", line)
    assert found and int(found.group(2)) == STEPS, line
    resumed = int(found.group(1))
    assert 2 <= resumed < STEPS, f"the crash came after the run's last step: give it more steps\n{first.output}"

    # The second actor started from that checkpoint and trained only the steps after it.
    events = log_events(actor_log)
    start = max(i for i, e in enumerate(events) if e["event"] == "actor_resumed")
    assert events[start]["step"] == resumed, events[start]
    done = [e for e in events[start:] if e["event"] == "step_done"]
    assert [e["step"] for e in done] == list(range(resumed + 1, STEPS + 1)), done
    # Every event of our own code in every role's log says whose it is: the run, the role, the worker id (the
    # process's: one per incarnation).
    run = first.config.run
    for role in ("feeder", "rollout", "reward", "actor", "metrics"):
        ours = [e for e in log_events(first.run_dir / "logs" / f"{role}-0.log") if _ours(e)]
        assert ours and all((e.get("run"), e.get("role")) == (run, role) and e.get("worker") for e in ours), ours
    before = {e["worker"] for e in events[:start] if e["event"] == "step_done"}
    assert len({e["worker"] for e in done}) == 1 and not before & {done[0]["worker"]}, (before, done)

    lines = (first.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [int(json.loads(line)["step"]) for line in lines] == list(range(1, STEPS + 1))
    await second.check_exactly_once(tmp_path)  # over both launches: every released group trained once or dropped


def _ours(event: dict[str, object]) -> bool:
    """Whether an event was logged by the project's code (a library's record may come before the role starts)."""
    return str(event.get("logger", "")).startswith(("workers.", "relax_bus."))

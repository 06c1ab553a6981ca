"""`relax run`'s restart policy: back-off that resets after a stable period, a failure budget per time
window (not per lifetime), and no restarts or failures once the run has ended."""

from __future__ import annotations

import pytest

from workers.config import parse_config
from workers.errors import RoleRefused, RunFailed
from workers.launch import processes as p

pytestmark = pytest.mark.unit


class _Exited:
    """A finished process handle: poll() gives its exit code."""

    def __init__(self, code: int) -> None:
        self.code = code

    def poll(self) -> int:
        return self.code


@pytest.fixture
def procs(tmp_path) -> p.RunProcesses:
    run = p.RunProcesses(parse_config({"run": "rb"}), "nats://127.0.0.1:1", tmp_path / "w", tmp_path / "logs")
    restarted: list[str] = []

    def restart(name: str, index: int = 0) -> None:  # what a real restart leaves behind, without a process
        role = run.get(name, index)
        role.restarts += 1
        role.next_start = 0.0
        role.proc = None
        restarted.append(role.label)

    run.restart = restart  # type: ignore[method-assign]
    run.restarted = restarted  # type: ignore[attr-defined]
    return run


def _crash(role: p.RoleProcess, started_at: float) -> None:
    role.proc = _Exited(-9)  # type: ignore[assignment]
    role.started_at = started_at


def test_failures_spread_over_time_never_stop_the_run(procs):
    actor, notes = procs.get("actor"), []
    t = 0.0
    for _ in range(12):  # twelve SIGKILLs, one every 30 s: never more than 5 inside 120 s
        _crash(actor, t - 30.0)
        procs.supervise(notes.append, now=t)
        procs.supervise(notes.append, now=t + 11.0)  # past the longest delay: restarted
        t += 30.0
    assert actor.restarts == 12 and procs.restarted.count("actor-0") == 12
    assert all("restart in" in n for n in notes)


def test_six_failures_within_the_window_stop_the_run(procs):
    actor, notes = procs.get("actor"), []
    for k in range(5):
        _crash(actor, float(k))
        procs.supervise(notes.append, now=float(k) + 0.5)
        procs.supervise(notes.append, now=float(k) + 0.9 + 10.0)
    delays = [n.split("restart in ")[1].split("s")[0] for n in notes]
    assert delays == ["1", "2", "5", "10", "10"], "backoff grows while the role keeps failing"
    _crash(actor, 20.0)
    with pytest.raises(RunFailed, match="6th failure within 120s without the run making progress"):
        procs.supervise(notes.append, now=21.0)


def test_failures_between_which_the_run_progressed_are_no_crash_loop(procs):
    """Six SIGKILLs of the actor within a minute, a step trained after each restart: the run goes on."""
    actor, notes = procs.get("actor"), []
    for k in range(8):
        _crash(actor, 10.0 * k)
        procs.supervise(notes.append, now=10.0 * k + 0.5)
        procs.supervise(notes.append, now=10.0 * k + 0.5 + 10.0)  # restarted
        procs.progressed(now=10.0 * k + 0.5 + 10.0 + 1.0)  # and it trained a step
    assert actor.restarts == 8 and len(actor.failures) == 1


def test_backoff_resets_after_a_stable_period(procs):
    actor, notes = procs.get("actor"), []
    for k in range(3):
        _crash(actor, float(k))
        procs.supervise(notes.append, now=float(k) + 0.5)
        procs.supervise(notes.append, now=float(k) + 20.0)
    _crash(actor, 100.0)  # up for 65 s this time
    procs.supervise(notes.append, now=165.0)
    assert notes[-1].endswith("restart in 1s (log: " + str(actor.log_path) + ")")


def test_nothing_is_restarted_once_the_run_has_ended(procs):
    actor, rollout = procs.get("actor"), procs.get("rollout")
    actor.proc, actor.finished = _Exited(0), True  # type: ignore[assignment]
    for k in range(10):
        _crash(rollout, float(k))
        procs.supervise(lambda note: None, now=float(k))
    assert procs.ended() and procs.restarted == [] and rollout.restarts == 0


def test_a_role_that_refuses_its_config_ends_the_run_with_its_reason(procs):
    """Exit 2 is a config the role cannot work with: not restarted, the run ends with the role's own error."""
    rollout, notes = procs.get("rollout"), []
    rollout.log_path.write_text(
        '{"event": "role_starting"}\n'
        "relax: error: invalid config run rb (rollout) (1 problem(s)):\n"
        "  - model.source: unknown model source '/gone'\n"
    )
    rollout.proc = _Exited(2)  # type: ignore[assignment]
    for _ in range(2):  # seen again: still no restart, the same reason
        with pytest.raises(RoleRefused) as refused:
            procs.supervise(notes.append, now=1.0)
        assert str(refused.value) == (
            "rollout-0 exited with 2 and is not restarted: invalid config run rb (rollout) (1 problem(s)):\n"
            "  - model.source: unknown model source '/gone'"
        )
    assert notes == [] and procs.restarted == [] and rollout.restarts == 0 and rollout.failures == []

"""`relax run`'s restart policy: back-off that resets after a stable period, a failure budget per time
window (not per lifetime) for a role that fails by itself the same way, none for a role stopped from outside,
and no restarts or failures once the run has ended."""

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


def _crash(role: p.RoleProcess, started_at: float, code: int = 1) -> None:
    """The role failed by itself (exit 1, by default) after running since `started_at`."""
    role.proc = _Exited(code)  # type: ignore[assignment]
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
    with pytest.raises(RunFailed, match="6th failure with the same error within 120s without the run making progress"):
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


def test_a_role_killed_from_outside_is_restarted_and_never_a_crash_loop(procs):
    """Twenty SIGKILLs (and SIGTERMs) of the rollout role within a minute and no step trained (a slow warm-up):
    each is restarted after the usual backoff, none counts towards a crash loop."""
    rollout, notes = procs.get("rollout"), []
    for k in range(20):
        _crash(rollout, 3.0 * k, code=-9 if k % 2 else -15)
        procs.supervise(notes.append, now=3.0 * k + 0.5)
        procs.supervise(notes.append, now=3.0 * k + 0.5 + 10.0)  # restarted
    assert rollout.restarts == 20 and rollout.failures == []
    kills = [n for n in notes if "from outside" in n]
    assert len(kills) == 20 and "rollout-0 was killed by SIGKILL (from outside, not a failure)" in kills[1]
    assert [n.split("restart in ")[1] for n in kills[:5]] == ["1s", "2s", "5s", "10s", "10s"], "still backed off"


def test_outside_kills_between_own_failures_do_not_hide_a_crash_loop(procs):
    """A role that fails by itself six times with the same error, killed from outside in between: a crash loop."""
    actor, notes = procs.get("actor"), []
    actor.log_path.write_text("relax: error: trainer step failed at update 12\n")
    for k in range(5):
        _crash(actor, 4.0 * k)
        procs.supervise(notes.append, now=4.0 * k + 0.5)
        procs.supervise(notes.append, now=4.0 * k + 0.5 + 10.0)
        _crash(actor, 4.0 * k + 1, code=-9)
        procs.supervise(notes.append, now=4.0 * k + 1.5)
        procs.supervise(notes.append, now=4.0 * k + 1.5 + 10.0)
    actor.log_path.write_text("relax: error: trainer step failed at update 13\n")  # numbers differ: the same error
    _crash(actor, 30.0)
    with pytest.raises(RunFailed, match="actor-0 exited with 1, its 6th failure with the same error"):
        procs.supervise(notes.append, now=31.0)


def test_different_failures_of_one_role_are_no_crash_loop_of_one_error(procs):
    """Six failures within the window, each with another error or exit code: the role is not failing the same way."""
    reward, notes = procs.get("reward"), []
    for k, (code, error) in enumerate([(1, "A"), (1, "B"), (3, "A"), (1, "C"), (4, "A"), (1, "D"), (1, "E")]):
        reward.log_path.write_text(f"relax: error: {error}\n")
        _crash(reward, float(k))
        reward.proc = _Exited(code)  # type: ignore[assignment]
        procs.supervise(notes.append, now=float(k) + 0.5)
        procs.supervise(notes.append, now=float(k) + 0.5 + 10.0)
    assert reward.restarts == 7 and len(reward.failures) == 7
    # Errors that never repeat (an id in each, say) still end the run at twice the limit.
    with pytest.raises(RunFailed, match="11th failure of its own"):
        for k, error in enumerate(["F", "G", "H", "I"], start=7):
            reward.log_path.write_text(f"relax: error: {error}\n")
            _crash(reward, float(k))
            reward.proc = _Exited(1)  # type: ignore[assignment]
            procs.supervise(notes.append, now=float(k) + 0.5)
            procs.supervise(notes.append, now=float(k) + 0.5 + 10.0)


def test_warm_up_progress_forgives_earlier_failures(procs):
    """The warm-up's events count as progress (`relax run` calls `progressed` on them): failures before one
    no longer count."""
    feeder, notes = procs.get("feeder"), []
    for k in range(12):
        _crash(feeder, 5.0 * k)
        procs.supervise(notes.append, now=5.0 * k + 0.5)
        procs.supervise(notes.append, now=5.0 * k + 0.5 + 10.0)
        if k % 4 == 3:
            procs.progressed(now=5.0 * k + 11.0)  # a `warmup_progress` event
    assert feeder.restarts == 12

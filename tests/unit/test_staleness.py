"""Exhaustive checks of the staleness rules over a grid of versions and bounds."""

import itertools

import pytest

from relax_bus.staleness import (
    Verdict,
    decide,
    is_stale,
    lag,
    must_sync,
    releasable,
    release_budget,
    sync_floor,
)

BOUNDS = [0, 1, 2, 5, None]


def test_lag_is_versions_behind():
    assert lag(7, 7) == 0
    assert lag(7, 4) == 3


@pytest.mark.parametrize(("trainer", "sample"), [(3, 4), (-1, 0), (2, -1)])
def test_lag_refuses_impossible_versions(trainer, sample):
    with pytest.raises(ValueError):
        lag(trainer, sample)


@pytest.mark.parametrize("bound", BOUNDS)
def test_stale_iff_lag_exceeds_bound(bound):
    for lag_ in range(0, 12):
        assert is_stale(lag_, bound) == (bound is not None and lag_ > bound)


def test_decide_over_the_grid():
    for trainer, sample, bound, action, attempt, max_rq in itertools.product(
        range(6), range(6), BOUNDS, ("drop", "requeue"), range(4), range(3)
    ):
        if sample > trainer:
            continue
        d = decide(trainer, sample, bound, action, attempt, max_rq)
        lag_ = trainer - sample
        assert d.lag == lag_
        if bound is None or lag_ <= bound:
            assert d.verdict is Verdict.TRAIN and d.reason == ""
        elif action == "requeue" and attempt < max_rq:
            assert d.verdict is Verdict.REQUEUE
            assert f"attempt {attempt + 1}" in d.reason
        else:
            assert d.verdict is Verdict.DROP
            assert f"lag {lag_} > max_staleness {bound}" in d.reason


def test_on_policy_trains_only_lag_zero():
    assert decide(4, 4, 0, "drop", 0, 0).verdict is Verdict.TRAIN
    assert decide(4, 3, 0, "drop", 0, 0).verdict is Verdict.DROP


def test_release_budget_formula():
    # (v + S + 1) * B + dropped
    assert release_budget(0, 0, 8, 0) == 8
    assert release_budget(0, 1, 8, 0) == 16
    assert release_budget(3, 2, 4, 5) == (3 + 2 + 1) * 4 + 5
    assert release_budget(10, None, 8, 3) is None


def test_releasable_never_negative_and_unbounded_is_none():
    for released, v, s, b, d in itertools.product(range(0, 40, 3), range(4), [0, 1, 2], [1, 4], [0, 2]):
        n = releasable(released, v, s, b, d)
        assert n == max(0, (v + s + 1) * b + d - released)
    assert releasable(10**6, 0, None, 8, 0) is None


def test_release_budget_refuses_nonsense():
    with pytest.raises(ValueError):
        release_budget(-1, 0, 8, 0)
    with pytest.raises(ValueError):
        release_budget(0, 0, 0, 0)


def test_sync_floor_and_must_sync():
    assert sync_floor(5, 0) == 5
    assert sync_floor(5, 2) == 3
    assert sync_floor(1, 4) == 0
    assert sync_floor(9, None) == 0
    for held, trainer, bound in itertools.product(range(6), range(6), BOUNDS):
        if held > trainer:
            continue
        assert must_sync(held, trainer, bound) == (bound is not None and trainer - held > bound)


def test_credit_rule_keeps_lag_within_bound():
    """Simulate the feeder and a trainer: every released group trains with lag <= S."""
    for bound, b in itertools.product([0, 1, 2], [1, 3]):
        released, queue = 0, []
        for version in range(20):
            n = releasable(released, version, bound, b, 0)
            # rollout generates every released group at the current version (it syncs first)
            queue += [version] * n
            released += n
            step, queue = queue[:b], queue[b:]
            assert len(step) == b
            assert all(version - v <= bound for v in step)

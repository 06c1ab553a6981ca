"""Dynamic sampling's pure pieces: uniform groups, the filtered set, the over-sampling bound, and the credit
rule with filtered credit simulated step by step (no deadlock at any staleness; the bound fails exactly)."""

import itertools
import json
import random

import pytest

from relax_bus.errors import ConfigError
from relax_bus.staleness import releasable
from tests.conftest import run_config
from workers.roles import filtered_credit as fc
from workers.roles.filtered_credit import count_below, exhausted, holds, is_uniform, oversample_cap, with_index

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("rewards", "uniform"),
    [
        ((), True),
        ((0.5,), True),
        ((0.0, 0.0, 0.0, 0.0), True),
        ((1.0, 1.0), True),
        ((-2.5, -2.5, -2.5), True),
        ((0.0, 1.0), False),
        ((1.0, 1.0, 1.0, 0.0), False),
        ((0.3, 0.3 + 1e-12), False),  # exact: any spread gives non-zero advantages
    ],
)
def test_a_group_is_uniform_when_every_reward_is_the_same(rewards, uniform):
    assert is_uniform(rewards) is uniform


def test_the_bitmap_matches_a_plain_set():
    rng = random.Random(7)
    for _ in range(50):
        indices = [rng.randrange(300) for _ in range(rng.randrange(60))]
        bitmap = b""
        for i in indices:
            bitmap = with_index(bitmap, i)
        assert with_index(bitmap, indices[0]) == bitmap if indices else True  # adding again changes nothing
        assert {i for i in range(310) if holds(bitmap, i)} == set(indices)
        for released in (0, 1, 7, 8, 9, 150, 299, 300, 10_000):
            assert count_below(bitmap, released) == len({i for i in indices if i < released}), released


def test_the_bitmap_refuses_a_negative_index_and_holds_nothing_out_of_range():
    with pytest.raises(ValueError, match="negative"):
        with_index(b"", -1)
    assert not holds(b"\xff", -1) and not holds(b"\xff", 8)
    assert count_below(b"\xff", -3) == 0


@pytest.mark.parametrize(
    ("ratio", "to_train", "cap"), [(1.0, 100, 0), (2.0, 24, 24), (1.5, 9, 4), (1.1, 10, 1), (3.0, 0, 0)]
)
def test_the_cap_is_the_filtered_groups_a_run_may_replace(ratio, to_train, cap):
    assert oversample_cap(ratio, to_train) == cap
    assert not exhausted(cap, cap) and exhausted(cap + 1, cap)


def test_the_cap_refuses_a_ratio_below_one():
    with pytest.raises(ValueError, match="max_oversample"):
        oversample_cap(0.5, 10)


def simulate(
    filter_p: float, staleness: int | None, steps: int, b: int, ratio: float, seed: int
) -> tuple[str, int, int]:
    """The feeder's rule with filtered credit against a trainer that needs `b` informative groups per step.

    Each round the feeder releases what the rule allows; every group in flight then lands (filtered with
    probability `filter_p`, else at the trainer), and the trainer takes as many steps as it holds groups
    for. Returns ("done" | "exhausted" | "deadlock", groups released).
    """
    rng = random.Random(seed)
    target, cap = steps * b, oversample_cap(ratio, steps * b)
    released = filtered = version = held = 0
    while version < steps:
        if exhausted(filtered, cap):
            return "exhausted", released, filtered
        need = target + filtered - released
        allowed = releasable(released, version, staleness, b, filtered)
        n = max(0, min(need, b if allowed is None else allowed))
        for _ in range(n):
            if rng.random() < filter_p:
                filtered += 1
            else:
                held += 1
        released += n
        trained = min(held // b, steps - version)
        if n == 0 and trained == 0:
            return "deadlock", released, filtered
        version += trained
        held -= trained * b
    return "done", released, filtered


@pytest.mark.parametrize(
    ("staleness", "filter_p", "ratio"),
    list(itertools.product([0, 1, 2, None], [0.0, 0.3, 0.7, 0.9, 1.0], [1.0, 2.0, 5.0])),
)
def test_filtered_credit_never_deadlocks_and_the_bound_fails_only_when_the_run_cannot_finish(
    staleness, filter_p, ratio
):
    steps, b = 6, 4
    target, cap = steps * b, oversample_cap(ratio, steps * b)
    for seed in range(20):
        outcome, released, filtered = simulate(filter_p, staleness, steps, b, ratio, seed)
        assert outcome != "deadlock", (seed, released)
        assert released <= target + cap, (seed, released)  # at most max_oversample releases per trained group
        if outcome == "exhausted":
            # Even if the feeder released every group the bound allows and none of the rest were filtered,
            # fewer than the run's groups would train: failing is exact, never early.
            assert filtered > cap and (target + cap) - filtered < target
        else:
            assert released - filtered == target  # every step got its informative groups
        if filter_p == 0.0:
            assert (outcome, released) == ("done", target)
        if filter_p == 1.0 and ratio == 1.0:
            assert outcome == "exhausted"


def test_the_sampling_section_is_validated_with_every_problem_named():
    assert run_config().sampling.drop_uniform is False
    assert run_config(sampling={"drop_uniform": True, "max_oversample": 3}).sampling.max_oversample == 3.0
    with pytest.raises(ConfigError) as err:
        run_config(sampling={"max_oversample": 0.5, "drop_uniformly": True})
    text = str(err.value)
    assert "sampling.max_oversample" in text and "greater than or equal to 1" in text
    assert "sampling.drop_uniformly" in text
    with pytest.raises(ConfigError, match=r"sampling\.max_oversample"):
        run_config(sampling={"max_oversample": float("inf")})


def test_the_kv_value_is_json_with_the_count_and_round_trips():
    bitmap = b""
    for index in (0, 3, 9, 700):
        bitmap = fc.with_index(bitmap, index)
    value = json.loads(fc.encode(bitmap))
    assert value["count"] == 4 and set(value) == {"count", "bits"}
    assert fc.decode(fc.encode(bitmap)) == bitmap
    assert fc.decode(b"") == b""

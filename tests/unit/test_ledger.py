"""The actor's ledger: a range set of trained release indices."""

import itertools
import random

import pytest

from workers.roles.ledger import RangeSet


def test_in_order_inserts_stay_one_range():
    s = RangeSet()
    for i in range(1000):
        s.add(i)
    assert s.ranges() == [[0, 1000]] and len(s) == 1000
    assert 999 in s and 1000 not in s


def test_random_order_matches_a_plain_set_and_merges_gaps():
    rng = random.Random(3)
    values = rng.sample(range(500), 300)
    s, plain = RangeSet(), set()
    for v in values:
        s.add(v)
        s.add(v)  # a duplicate changes nothing
        plain.add(v)
        assert all((x in s) == (x in plain) for x in range(-1, 502))
    assert len(s) == len(plain)
    ranges = s.ranges()
    assert all(a[1] < b[0] for a, b in itertools.pairwise(ranges)), "disjoint and not adjacent"
    assert RangeSet.from_ranges(reversed(ranges)).ranges() == ranges


def test_from_ranges_merges_overlaps_and_skips_empty():
    assert RangeSet.from_ranges([[5, 7], [0, 2], [2, 3], [6, 9], [4, 4]]).ranges() == [[0, 3], [5, 9]]


def test_negative_values_are_refused():
    with pytest.raises(ValueError, match="non-negative"):
        RangeSet().add(-1)

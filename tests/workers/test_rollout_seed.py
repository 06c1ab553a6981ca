"""A group's sampling seed: a pure function of the base seed, the run, the group id and the attempt."""

from __future__ import annotations

import pytest

from tests import factories as f
from workers.roles.rollout import group_seed

pytestmark = pytest.mark.workers


def test_group_seed_depends_on_the_group_and_its_attempt_only() -> None:
    prompt = f.prompt("r1", 3)
    seed = group_seed(0, prompt)
    assert seed == group_seed(0, prompt.model_copy()) and 0 <= seed < 2**31
    assert group_seed(0, prompt.model_copy(update={"released_at_version": 9})) == seed  # not on release time
    others = [
        group_seed(1, prompt),
        group_seed(0, f.prompt("r1", 4)),
        group_seed(0, f.prompt("r2", 3)),
        group_seed(0, prompt.model_copy(update={"attempt": 1})),  # a requeued group samples afresh
    ]
    assert seed not in others and len(set(others)) == len(others)

"""The sequence cap at the rollout: a `rollout.max_new_tokens` that fills the model's context by itself leaves no
room for any prompt, so the role refuses it at start with one config error (a prompt too long for what is left is
dead-lettered on its own: tests/e2e/test_bad_input.py)."""

from __future__ import annotations

import uuid

import pytest

from relax_bus.errors import ConfigError
from tests.e2e.cluster import small_config
from workers.config import parse_config
from workers.roles.rollout import rollout_worker

pytestmark = [pytest.mark.workers, pytest.mark.bus]


async def test_max_new_tokens_that_fill_the_context_are_refused_at_start(make_bus, tmp_path, one_torch_thread):
    config = parse_config(small_config(f"ctx{uuid.uuid4().hex[:8]}", rollout={"max_new_tokens": 256}))
    bus = await make_bus(config)
    with pytest.raises(ConfigError, match=r"256 new tokens leave no room for a prompt in the model's context of 256"):
        await rollout_worker(bus, tmp_path)


async def test_max_new_tokens_that_leave_room_start(make_bus, tmp_path, one_torch_thread):
    config = parse_config(small_config(f"ctx{uuid.uuid4().hex[:8]}", rollout={"max_new_tokens": 255}))
    worker, rollout = await rollout_worker(await make_bus(config), tmp_path)
    assert rollout.engine.max_context == 256 and worker.role.name == "rollout"

"""PPO with GAE end to end: every role a process on a real nats-server, the critic the last role before the trainer
(reward -> scored -> critic -> train), SIGKILLed while it holds groups that no checkpoint covers yet, and started
again. Every released group is trained once by the actor, on the critic's values; the critic's own updates are
exact: its last checkpoint's version equals the groups its ledger holds, the successor trained again exactly the
groups its predecessor trained after that checkpoint, and none of the actor's groups is missing from the critic's
history. The value loss falls."""

from __future__ import annotations

import io
import json
import uuid

import pytest
import torch

from tests.e2e.cluster import Cluster, role_events, small_config
from tests.e2e.test_pipeline import run
from tests.waiting import until
from workers.config import parse_config
from workers.state_keys import CRITIC_CHECKPOINT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

EVERY = 3  # critic.checkpoint_every: the kill lands between two of its checkpoints


def ppo_config(run: str) -> dict:
    """The small e2e run as PPO with GAE; a format reward that every completion earns puts the returns near 1 (a
    critic that starts at 0 has a clear value loss to lose), the exact-match reward varies them."""
    return small_config(
        run,
        groups_per_step=4,
        trainer={"steps": 12, "advantage": "gae", "optim": {"lr": 1e-3}},
        rewards=[{"type": "exact"}, {"type": "format", "options": {"pattern": "(?s).*"}}],
        critic={"lr": 3e-3, "gamma": 1.0, "lam": 0.95, "updates": 2, "checkpoint_every": EVERY},
    )


async def test_ppo_with_a_critic_killed_mid_batch_trains_every_group_once_and_its_value_loss_falls(
    nats_server, tmp_path
):
    config = parse_config(ppo_config(f"critic{uuid.uuid4().hex[:8]}"))
    assert [r.name for r in config.chain][2:4] == ["reward", "critic"]
    killed: dict[str, list[str]] = {}

    async def crash_the_critic(cluster: Cluster) -> None:
        await cluster.wait_step(4)
        critic = cluster.role("critic")
        # Kill it while it holds trained groups no checkpoint covers (a count between two checkpoints).
        held = await until(
            lambda: [e["group_id"] for e in role_events(critic, "critic_trained")],
            lambda ids: len(ids) % EVERY != 0,
            60,
            "the critic holding groups between checkpoints",
        )
        cluster.kill("critic")
        killed["trained"] = [e["group_id"] for e in role_events(critic, "critic_trained")]
        assert len(killed["trained"]) >= len(held)
        cluster.restart("critic")

    cluster = await run(nats_server, tmp_path, config, crash_the_critic)
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        trained = set(acc.trained)
        groups = [g for g in acc.train_groups if g.group_id in trained]
        assert all(g.critic is not None for g in groups)

        # The critic's history: its last checkpoint, and what each incarnation trained.
        assert cluster.bus is not None
        record = json.loads(await cluster.bus.run_state.get(CRITIC_CHECKPOINT) or b"{}")
        state = torch.load(io.BytesIO(await cluster.bus.checkpoints.get(record["object"])), weights_only=True)
        ledger = {key.rsplit("/", 1)[0] for key in state["extra"]["trained"]}
        version = int(state["extra"]["version"])
        assert version == len(state["extra"]["trained"]) == record["version"], (version, record)
        events = role_events(cluster.role("critic"), "critic_trained")
        first, second = killed["trained"], [e["group_id"] for e in events[len(killed["trained"]) :]]
        ready = role_events(cluster.role("critic"), "critic_ready")
        assert len(ready) == 2 and ready[1]["resumed"], ready
        resumed_at = int(ready[1]["version"])
        assert resumed_at % EVERY == 0 and resumed_at < len(first), (resumed_at, len(first))
        # The successor trained again what the predecessor had trained after its last checkpoint.
        assert set(first[resumed_at:]) <= set(second), (first[resumed_at:], second)
        effective = first[:resumed_at] + second
        assert len(effective) == len(set(effective)), "a group trained twice in the critic's effective history"
        assert set(effective) >= ledger and len(effective) - len(ledger) < EVERY  # the rest: held at the end
        assert trained <= set(effective), sorted(trained - set(effective))

        losses = [m.values["value_loss"] for m in acc.metrics]
        assert len(losses) == config.trainer.steps
        head, tail = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        print(f"value loss by step: {[round(v, 3) for v in losses]}")
        assert tail < 0.5 * head, (head, tail)
    finally:
        await cluster.stop()

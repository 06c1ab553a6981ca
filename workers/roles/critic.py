"""The critic role: the value model of PPO with GAE; per-token values for the actor, and its own updates.

In the chain only in a run with a `critic` section, as the last role before the trainer: scored -> critic -> train,
or scored -> reference -> critique -> critic -> train with a KL term. One process (its updates are sequential).

A batch role of the bus's worker loop (`relax_bus.batch_worker`), whose batch is `critic.checkpoint_every` groups,
or those it holds once its input has been idle for `critic.idle_checkpoint_s` (so the groups of a run's last steps,
or of a pipeline that waits for a dead letter's replacement, are acked without waiting for more):

    admit    a group already trained (the ledger holds its `group_id/attempt`) is a copy: acked, nothing else.
             Otherwise: V_old of its tokens with the current weights, `critic.updates` value-loss steps on its GAE
             returns (`workers.training.value_model`), and the group published on to the trainer with V_old
             (`TrainGroup.critic`); it is held, not acked
    handle   a checkpoint of the weights, the optimizer, the version and the ledger, written whole (the object,
             then the KV record `critic.checkpoint` that names it), before the loop acks the batch

So every acked group's update is in a checkpoint, and every update not in one belongs to a group not acked yet. A
critic restarted (SIGKILL included) loads the newest checkpoint and rewinds its durable: the groups it held come
back at once; those the checkpoint trained are acked as copies, the others are trained again on the checkpoint's
weights and published again (the trainer keeps the first copy of a group). Each group is trained once in effect,
and none is lost. Held groups do not hold the run up: they went on to the trainer when admitted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from relax_bus.batch_worker import BatchWorker, Held
from relax_bus.bus import Bus
from relax_bus.control import Reject, Skip
from relax_bus.delivery import Delivery, WorkerOptions
from relax_bus.log import get_logger
from relax_bus.outage import through_outage
from relax_bus.policy_version import VersionTracker
from schemas import RunEvent, ScoredGroup, TrainGroup
from workers.data.models import load_model, materialize
from workers.roles.serve import RoleContext
from workers.state_keys import CRITIC_CHECKPOINT
from workers.training.devices import resolve_device
from workers.training.value_model import CriticTrainer
from workers.weights import make_transport

log = get_logger(__name__)

CHECKPOINT_PREFIX = "critic-"
"""The critic's objects in the checkpoints store are `critic-<version>` (the actor's are `ckpt-<step>`)."""


@dataclass
class CriticState:
    """What survives a restart besides the weights and optimizer (inside each checkpoint)."""

    trained: set[str] = field(default_factory=set)
    """`group_id/attempt` of every group the critic trained on."""
    kept: list[str] = field(default_factory=list)
    """The checkpoint objects kept, oldest first."""

    def to_extra(self) -> dict[str, Any]:
        return {"trained": sorted(self.trained)}

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> CriticState:
        return cls(trained=set(extra.get("trained", [])))


def group_key(group: TrainGroup) -> str:
    """The ledger's key of a group: `group_id/attempt` (a requeued group's new attempt is a new sample)."""
    return f"{group.group_id}/{group.prompt.attempt}"


async def serve(ctx: RoleContext) -> None:
    """`relax worker critic`: the value model from the policy's version 0, resumed from its checkpoint."""
    bus = ctx.connected
    cfg = bus.config
    if cfg.critic is None:
        raise ValueError("the run has no critic section")
    model_dir = await asyncio.to_thread(materialize, cfg.model.source, ctx.cache / "base", cfg.model.seed)
    lm = await asyncio.to_thread(load_model, model_dir)
    critic = Critic(bus, CriticTrainer(lm, cfg.critic, resolve_device(cfg.trainer.compute.device)))
    async with critic.worker.alive():
        await critic.setup(lm)
        await critic.worker.run(stop=ctx.stop)


class Critic:
    """The critic as a batch role of the bus's loop; the math lives in `CriticTrainer`."""

    def __init__(self, bus: Bus, trainer: CriticTrainer, options: WorkerOptions | None = None) -> None:
        self.bus = bus
        self.trainer = trainer
        self.config = bus.config.critic
        self.state = CriticState()
        self.role = bus.topology.role("critic")
        self._holding: set[str] = set()
        """Keys of the groups trained since the last checkpoint (held, not acked)."""
        self.worker = BatchWorker(
            bus,
            "critic",
            self,
            TrainGroup if self.role.input != "scored" else ScoredGroup,  # type: ignore[arg-type]
            lambda: self.config.checkpoint_every,
            options or WorkerOptions(fetch_timeout_s=1.0),
            read_ahead=False,
            flush_idle_s=self.config.idle_checkpoint_s,
        )

    async def setup(self, lm: torch.nn.Module) -> None:
        """Resume from the newest checkpoint, or start from the policy's version 0; rewind the durable so the
        groups a predecessor held come back at once."""
        record = await self._record()
        if record is not None:
            data = await through_outage(lambda: self.bus.checkpoints.get(record["object"]), "read critic checkpoint")
            extra = await asyncio.to_thread(self.trainer.restore, data)
            self.state = CriticState.from_extra(extra)
            self.state.kept = list(record.get("kept", [record["object"]]))
            log.info("critic_resumed", version=self.trainer.version, trained=len(self.state.trained))
        else:
            tracker = await VersionTracker(self.bus.version).start()
            log.info("critic_waiting_for_v0")
            await tracker.wait_for(0)  # the actor publishes v0 after its warm-up
            await tracker.stop()
            state = await make_transport(self.bus).read(0)
            lm.load_state_dict(state)
            self.trainer.model.body.load_state_dict(lm.get_decoder().state_dict())  # type: ignore[operator]
        await self.worker.rewind()
        log.info("critic_ready", version=self.trainer.version, resumed=record is not None)
        await self._event("critic_ready", version=self.trainer.version, resumed=record is not None)

    async def admit(self, message: TrainGroup | ScoredGroup, delivery: Delivery, held: Sequence[Held[Any]]) -> None:
        """Train on a new group and publish it on with its values; `Skip` a copy."""
        group = message if isinstance(message, TrainGroup) else TrainGroup(scored=message)
        key = group_key(group)
        if key in self.state.trained or key in self._holding:
            raise Skip()  # trained (and published) before: a copy, or a redelivery after a restart
        try:
            values = await asyncio.to_thread(self.trainer.train, group)
        except ValueError as err:
            raise Reject(f"the critic cannot train on group {group.group_id}: {err}") from None
        assert self.role.output is not None
        await self.bus.publish(self.role.output, group.model_copy(update={"critic": values}))
        self._holding.add(key)
        log.info("critic_trained", group_id=group.group_id, version=self.trainer.version, loss=values.value_loss)

    async def handle(self, batch: Sequence[Held[Any]]) -> None:
        """Checkpoint the updates of the batch's groups before the loop acks them."""
        self.state.trained |= self._holding
        data = await asyncio.to_thread(self.trainer.to_bytes, self.state.to_extra())
        name = f"{CHECKPOINT_PREFIX}{self.trainer.version}"
        await through_outage(lambda: self.bus.checkpoints.put(name, data), f"put critic checkpoint {name}")
        kept = [*[k for k in self.state.kept if k != name], name]
        pruned, self.state.kept = kept[: -self.config.keep], kept[-self.config.keep :]
        record = {"object": name, "version": self.trainer.version, "kept": self.state.kept}
        await self.bus.run_state.put(CRITIC_CHECKPOINT, json.dumps(record).encode())
        for gone in pruned:
            await through_outage(lambda gone=gone: self.bus.checkpoints.delete(gone), f"delete {gone}")
        self._holding.clear()
        log.info("critic_checkpoint_saved", **record)

    async def settled(self, batch: Sequence[Held[Any]]) -> None:
        """After the acks: an event for the run's record (the groups the checkpoint covers)."""
        await self._event("critic_checkpoint", version=self.trainer.version, groups=len(batch))

    async def _record(self) -> dict[str, Any] | None:
        value = await self.bus.run_state.get(CRITIC_CHECKPOINT)
        return json.loads(value) if value else None

    async def _event(self, event: str, **fields: Any) -> None:
        await self.bus.publish("events", RunEvent(run=self.bus.run, event=event, source="critic", fields=fields))

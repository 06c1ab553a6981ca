"""The role registry: the only list of roles. Everything else (the chain of a run, hence its topology
and NATS permissions, `relax worker`, `relax run`, the test harnesses) reads it.

A role is one module under `workers/roles/` with an `async def serve(ctx: RoleContext) -> None`, plus
one entry here: its name, the hop it reads, the hop it writes, what else it touches (`Grants`), and
when it is part of a run. The module is imported only by the process that runs the role, so a
role whose code needs no torch never loads it.

    feeder     publish prompts; write feeder.cursor; watch policy.version; follow dead letters
    rollout    pull prompts, publish rollouts; read weights, watch policy.version
    reward     pull rollouts, publish scored (train when the run has no reference role)
    reference  pull scored, publish train; read weights, watch policy.version
    actor      pull train, rewind its durable; publish prompts (requeues); write weights,
               policy.version, trainer.*, groups.dropped
    metrics    follow events (its own durable, rewound to its ack floor), write the sinks; read the
               run's consumer, stream and worker state (Prometheus gauges)
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relax_bus.state_keys import (
    FEEDER_CURSOR,
    GROUPS_DROPPED,
    GROUPS_FILTERED,
    POLICY_VERSION,
    TRAINER_CHECKPOINT,
    TRAINER_DONE,
    TRAINER_STEP,
    WEIGHTS_BROADCAST,
)

if TYPE_CHECKING:
    from relax_bus.chain import Role
    from workers.config import PipelineConfig


def _always(config: PipelineConfig) -> bool:
    return True


def _with_reference(config: PipelineConfig) -> bool:
    return config.reference


def _with_metrics(config: PipelineConfig) -> bool:
    return config.metrics.enabled


def _one(config: PipelineConfig) -> int:
    return 1


@dataclass(frozen=True)
class RoleDef:
    """One role: where it sits in the chain and where its code is."""

    name: str
    input: str | None
    output: Callable[[PipelineConfig], str | None]
    grants: dict[str, Any]
    """Keyword arguments of its `relax_bus.chain.Grants` (kept plain so reading the registry is cheap)."""
    module: str
    """Module with `async def serve(ctx)`; imported only when the role runs."""
    enabled: Callable[[PipelineConfig], bool] = _always
    """Whether a run with this config has the role."""
    why_absent: str = ""
    """Said when someone starts the role in a run that has none."""
    torch_threads: bool = True
    """Whether `relax worker --threads` applies (the role runs torch)."""
    processes: Callable[[PipelineConfig], int] = _one
    """How many processes of the role `relax run` starts."""
    ranks: Callable[[PipelineConfig], int] = _one
    """Processes per instance: above 1, `relax run` starts the role under torchrun with that many ranks."""
    nodes: Callable[[PipelineConfig], int] = _one
    """Machines one instance spans, each with `ranks` processes: above 1, `relax worker` re-executes itself
    under torchrun with a c10d rendezvous, and `relax run` starts that many torchrun agents on this machine."""
    ends_run: bool = False
    """The run is over when this role exits by itself (the trainer, after its last step)."""
    exits_when_done: bool = False
    """Exits 0 by itself once the run is done (the others run until stopped)."""

    def role(self, config: PipelineConfig) -> Role:
        """Its place in the chain of a run with `config`."""
        from relax_bus.chain import Grants, Role

        return Role(name=self.name, input=self.input, output=self.output(config), grants=Grants(**self.grants))

    def serve(self) -> Callable[[Any], Awaitable[None]]:
        """The role's entry point (imports its module)."""
        fn: Callable[[Any], Awaitable[None]] = importlib.import_module(self.module).serve
        return fn


ROLES: tuple[RoleDef, ...] = (
    RoleDef(
        "feeder",
        input=None,
        output=lambda c: "prompts",
        grants=dict(state_keys=(FEEDER_CURSOR,), reaps=False, reads_dead_letters=True, watches_version=True),
        module="workers.roles.feeder",
        torch_threads=False,
        exits_when_done=True,
    ),
    RoleDef(
        "rollout",
        input="prompts",
        output=lambda c: "rollouts",
        grants=dict(reads_weights=True, watches_version=True),
        module="workers.roles.rollout",
        processes=lambda c: c.roles.rollout,
    ),
    RoleDef(
        "reward",
        input="rollouts",
        output=lambda c: "scored" if c.reference else "train",
        grants=dict(state_keys=(GROUPS_FILTERED,)),  # dynamic sampling's filtered set
        module="workers.roles.reward",
        torch_threads=False,
        processes=lambda c: c.roles.reward,
    ),
    RoleDef(
        "reference",
        input="scored",
        output=lambda c: "train",
        grants=dict(reads_weights=True, watches_version=True),
        module="workers.roles.reference",
        enabled=_with_reference,
        why_absent="trainer.kl_coef is 0",
        processes=lambda c: c.roles.reference,
    ),
    RoleDef(
        "actor",
        input="train",
        output=lambda c: None,
        grants=dict(
            state_keys=(
                POLICY_VERSION,
                GROUPS_DROPPED,
                TRAINER_STEP,
                TRAINER_CHECKPOINT,
                TRAINER_DONE,
                WEIGHTS_BROADCAST,
            ),
            publishes=("prompts",),
            reads_weights=True,
            writes_weights=True,
            reaps=False,
            resets_consumer=True,
        ),
        module="workers.roles.actor",
        ranks=lambda c: c.trainer.nproc,
        nodes=lambda c: c.trainer.nnodes,
        ends_run=True,
        exits_when_done=True,
    ),
    RoleDef(
        "metrics",
        input="events",
        output=lambda c: None,
        grants=dict(reaps=False, resets_consumer=True, observes=True),
        module="workers.roles.metrics",
        enabled=_with_metrics,
        why_absent="metrics.enabled is false",
        torch_threads=False,
    ),
)
ROLE_NAMES = tuple(r.name for r in ROLES)


def role_def(name: str) -> RoleDef:
    """The registry entry of `name`; ValueError naming the known roles otherwise."""
    for r in ROLES:
        if r.name == name:
            return r
    raise ValueError(f"unknown role {name!r} (roles: {', '.join(ROLE_NAMES)})")


def chain_of(config: PipelineConfig) -> tuple[Role, ...]:
    """The roles of a run with `config`, in order."""
    return tuple(r.role(config) for r in ROLES if r.enabled(config))

"""The chain of roles of a run, as data: which hop each role reads and writes, and what else it touches.

The bus knows no role by name. The process that loads a run config (the `relax` command, a test, a
benchmark) fills `RunConfig.chain` from its role registry; `relax init` stores it with the config, and
the topology (consumers), the credentials (`relax auth`) and `relax inspect` read it from there.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

HOPS = ("prompts", "rollouts", "scored")
"""The work-queue streams between stages."""
SUBJECT_KEYS = ("prompts", "rollouts", "scored", "train", "dlq", "events")
"""Every stream of a run, by key."""
RESERVED = ("admin", "observer")
"""Names of the NATS users `relax auth` writes besides the roles' (`relax_bus.auth`)."""


class Grants(BaseModel):
    """What a role's own code does beyond consuming its input and publishing its output."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    state_keys: tuple[str, ...] = ()
    """Keys of the run's state bucket it writes."""
    publishes: tuple[str, ...] = ()
    """Subject keys it publishes to besides its output, dlq and events."""
    reads_weights: bool = False
    """Fetches policy weights from the weights store."""
    writes_weights: bool = False
    """Puts and deletes weights and checkpoints in the weights store."""
    watches_version: bool = False
    """Follows policy.version with a KV watcher (an ordered consumer on the state bucket)."""
    reaps: bool = True
    """Runs the bus's worker loop, which dead-letters (reads, then deletes) unsettled input messages."""
    resets_consumer: bool = False
    """Rewinds its own durable after a restart (`js.reset_consumer`)."""
    reads_dead_letters: bool = False
    """Follows the dlq stream (the feeder replaces dead-lettered groups)."""
    observes: bool = False
    """Reads the info of every stream and consumer of the run (queue depths for dashboards), as the observer."""


class Role(BaseModel):
    """Where one role reads from and writes to."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")
    """Role name: it names the durable consumer, the NATS user and the heartbeat keys."""
    input: str | None = None
    """Subject key it consumes (None: the role has no input stream)."""
    output: str | None = None
    """Subject key its handler's results go to (None: it publishes nothing downstream)."""
    grants: Grants = Field(default_factory=Grants)
    """What else it may touch (`relax auth` turns this into NATS permissions)."""


def chain_problems(chain: tuple[Role, ...]) -> list[str]:
    """Why `chain` cannot be a run's topology (empty when it can)."""
    problems = []
    names = [r.name for r in chain]
    if duplicated := sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"roles named more than once: {duplicated}")
    if reserved := sorted(set(names) & set(RESERVED)):
        problems.append(f"role names reserved for the run's other NATS users: {reserved}")
    inputs = [r.input for r in chain if r.input is not None]
    if shared := sorted({i for i in inputs if inputs.count(i) > 1}):
        problems.append(f"streams read by more than one role (one durable per work queue): {shared}")
    for r in chain:
        for what, key in (("input", r.input), ("output", r.output), *(("publishes", k) for k in r.grants.publishes)):
            if key is not None and key not in SUBJECT_KEYS:
                problems.append(f"role {r.name}: {what} {key!r} is not a stream (streams: {', '.join(SUBJECT_KEYS)})")
    return problems

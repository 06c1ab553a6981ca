"""The chain of roles of a run, as data: which hop each role reads and writes, and what else it touches.

The bus knows no role and no hop by name. The process that loads a run config (the `relax` command, a test,
a benchmark) fills `RunConfig.chain` from its role registry; `relax init` stores it with the config, and
the topology (streams and consumers), the credentials (`relax auth`) and `relax inspect` read it from there.
A hop (a work-queue stream) is any key a role of the chain reads or writes that is not one of the run's
limits streams (`hop_keys`): a new stage with a new hop edits the registry only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

LIMITS_STREAMS = ("train", "dlq", "events")
"""The run's limits streams, whatever its chain: the trainer's input (kept for replay), dead letters, events."""
KEY_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"
"""What a stream key looks like (it names the stream and its subject)."""
RESERVED = ("admin", "observer")
"""Names of the NATS users `relax auth` writes besides the roles' (`relax_bus.ops.auth`)."""


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
    writes_checkpoints: bool = False
    """Puts, reads and deletes its own checkpoints in the checkpoints store (a role with a model of its own: the
    critic); `writes_weights` includes it."""
    watches_version: bool = False
    """Follows policy.version (a core subscription to its key's subject wakes it; the key is read by direct get)."""
    reaps: bool = True
    """Runs the bus's worker loop, which dead-letters (reads, then deletes) unsettled input messages."""
    resets_consumer: bool = False
    """Rewinds its own durable after a restart (`js.reset_consumer`)."""
    reads_dead_letters: bool = False
    """Follows the dlq stream (the feeder replaces dead-lettered groups)."""
    records_episodes: bool = False
    """Writes, reads and deletes the records of multi-turn episodes in the episodes bucket (the rollout role)."""
    observes: bool = False
    """Reads the info of every stream and consumer of the run (queue depths for dashboards), as the observer."""
    calls_env: bool = False
    """Sends requests to the run's environment service (reset, step, close: the rollout's episodes)."""
    serves_env: bool = False
    """Is an environment server: answers the run's environment requests and the service's discovery requests,
    and publishes nothing but those replies and its heartbeats (no stream, no dead letter, no event)."""


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


def hop_keys(chain: Iterable[Role], declared: Sequence[str] = ()) -> tuple[str, ...]:
    """The work-queue streams of a run, by key: `declared` first, then every key a role of `chain` reads or
    writes (input, output, `Grants.publishes`) that is not a limits stream, in chain order, each once."""
    keys = [k for k in declared if k not in LIMITS_STREAMS]
    for r in chain:
        for key in (r.input, r.output, *r.grants.publishes):
            if key is not None and key not in LIMITS_STREAMS and key not in keys:
                keys.append(key)
    return tuple(keys)


def chain_problems(chain: tuple[Role, ...], hops: Sequence[str] = ()) -> list[str]:
    """Why `chain`, with the declared `hops`, cannot be a run's topology (empty when it can)."""
    problems = []
    if bad := [k for k in hops if k in LIMITS_STREAMS or not re.match(KEY_PATTERN, k)]:
        problems.append(f"hops {bad} are not hop keys ({KEY_PATTERN}, none of {', '.join(LIMITS_STREAMS)})")
    names = [r.name for r in chain]
    if duplicated := sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"roles named more than once: {duplicated}")
    if reserved := sorted(set(names) & set(RESERVED)):
        problems.append(f"role names reserved for the run's other NATS users: {reserved}")
    inputs = [r.input for r in chain if r.input is not None]
    if shared := sorted({i for i in inputs if inputs.count(i) > 1}):
        problems.append(f"streams read by more than one role (one durable per work queue): {shared}")
    written = {k for r in chain for k in (r.output, *r.grants.publishes) if k is not None}
    for r in chain:
        for what, key in (("input", r.input), ("output", r.output), *(("publishes", k) for k in r.grants.publishes)):
            if key is not None and not re.match(KEY_PATTERN, key):
                problems.append(f"role {r.name}: {what} {key!r} is not a stream key ({KEY_PATTERN})")
        if r.input is not None and r.input not in LIMITS_STREAMS and r.input not in written:
            problems.append(f"role {r.name}: input {r.input!r} is a hop no role of the chain publishes to")
    return problems

"""Least-privilege NATS credentials for a run: one user per role, allowed only the subjects it uses.

`permissions(topology, role)` derives a role's publish and subscribe allow-lists from the run's
chain (each role's input, output and `Grants`, declared by the role registry of the roles' package)
and from what the bus's worker loop calls; the server denies everything else;
`relax_bus.ops.credentials` writes them into a server config (`relax auth`). Every role user may read
the run config and KV and write its own heartbeats, dead letters and events, and may read single
messages back (by sequence) from each stream it publishes to: a publish answered "duplicate" is
checked against the copy stored under its id. Two users exist besides the roles:

    admin      every JetStream call on the run's streams, consumers, buckets and stores
    observer   read-only: stream and consumer info, KV, dead letters, events, the environment servers' figures
               (`relax inspect`)

An environment server (`Grants.serves_env`) is the exception to the rule above: it touches no stream. It joins
the run's environment queue group, answers the service's discovery requests, and publishes only its replies
(nats-server's `allow_responses`: one reply per request received) and its heartbeats. A role that
`calls_env` may send it requests; no other role may touch the environment subjects.

Only the admin creates, updates or deletes streams and consumers. No other user may create a consumer of any
kind: a push consumer delivers to whatever subject its creator names, API and advisory subjects included,
whatever that user may publish (nats-server does not check it), so one stolen credential could reset another
role's durable or forge a server advisory. Roles consume through the durables the admin made for them and read
everything else (object chunks, KV entries, events, dead letters) by direct get (`relax_bus.direct_get`); a
plain core-NATS subscription to the policy version's key wakes its readers early.
Replies arrive under a per-user inbox prefix (`_INBOX.<user>`), so no user reads another's replies.
"""

from __future__ import annotations

from dataclasses import dataclass

from relax_bus.staleness import POLICY_VERSION
from relax_bus.topology import Topology

API = "$JS.API"
ADMIN = "admin"
OBSERVER = "observer"


@dataclass(frozen=True)
class Permissions:
    """The subjects one NATS user may publish and subscribe to; everything else is denied."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    """Subjects, each optionally followed by a space and the only queue group it may be joined in."""
    allow_responses: bool = False
    """May also publish one reply to each request it received (to the request's reply subject), wherever that is."""


def user_name(run: str, role: str) -> str:
    """The NATS user of `role` in `run`."""
    return f"{run}-{role}"


def inbox_prefix(run: str, role: str) -> str:
    """The reply-subject prefix of `role`'s user (its only subscribable inbox)."""
    return f"_INBOX.{user_name(run, role)}"


def users(topology: Topology) -> tuple[str, ...]:
    """Every role that gets a user: the run's roles, then admin and observer."""
    return (*(r.name for r in topology.roles), ADMIN, OBSERVER)


def permissions(topology: Topology, role: str) -> Permissions:
    """The allow-lists of `role` (one of `users(topology)`) in the run of `topology`."""
    t = topology
    inbox = f"{inbox_prefix(t.run, role)}.>"
    if role == ADMIN:
        return _admin(t, inbox)
    if role == OBSERVER:
        return _observer(t, inbox)
    r = t.role(role)
    g = r.grants
    state, workers = t.bucket("state"), t.bucket("workers")
    if g.serves_env:
        return _env_server(t, role, inbox)
    media, weights, checkpoints = (t.object_store(k) for k in ("media", "weights", "checkpoints"))
    outputs = [*([r.output] if r.output else []), *g.publishes, "dlq", "events"]
    pub = [
        *_reads_kv(state),
        *_reads_kv(workers),
        f"$KV.{workers}.{role}.>",  # its own heartbeats: keys <role>.<worker id>
        *(f"$KV.{state}.{key}" for key in g.state_keys),
        *_reads_store(media),
        f"$O.{media}.>",  # claim checks of large payloads go both ways on every hop
        *(t.subject(k) for k in outputs),
        # Reading back the copy a duplicate's id points at: is it ours, or a forgery (`relax_bus.publisher`)?
        *(f"{API}.STREAM.MSG.GET.{t.stream(k).name}" for k in outputs),
    ]
    sub = [inbox]
    if r.input is not None:
        stream, durable = t.stream(r.input).name, t.consumer(r.input).durable
        pub += [
            f"{API}.CONSUMER.MSG.NEXT.{stream}.{durable}",
            f"{API}.CONSUMER.INFO.{stream}.{durable}",
            f"$JS.ACK.{stream}.{durable}.>",
        ]
        if g.reaps:
            pub += [f"{API}.STREAM.MSG.GET.{stream}", f"{API}.STREAM.MSG.DELETE.{stream}"]
            sub.append(f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{durable}")
        if g.resets_consumer:
            pub.append(f"{API}.CONSUMER.RESET.{stream}.{durable}")
    if g.watches_version:
        sub.append(f"$KV.{state}.{POLICY_VERSION}")  # a wake-up only: the value is read from the bucket
    if g.reads_weights:
        pub += _reads_store(weights)
    if g.reads_dead_letters:
        pub += _direct_reader(t.stream("dlq").name)
    if g.writes_weights:
        # The trainer's stores: versions, and checkpoints nobody else reads (optimizer state, the ledger). The
        # stream's info: its subjects, to find the chunks of an upload a crash cut off (`clear_orphans`).
        for store in (weights, checkpoints):
            pub += [f"$O.{store}.>", f"{API}.STREAM.PURGE.OBJ_{store}", *_reads_store(store)]
    if g.writes_checkpoints and not g.writes_weights:
        # Its own checkpoints (the critic's); the weights store stays the trainer's.
        pub += [f"$O.{checkpoints}.>", *_reads_store(checkpoints)]
    if g.records_episodes:
        episodes = t.bucket("episodes")
        pub += [*_reads_kv(episodes), f"$KV.{episodes}.>"]
    if g.observes:
        pub += _infos(t)
    if g.calls_env:
        pub += t.env.endpoints()
    return Permissions(tuple(dict.fromkeys(pub)), tuple(dict.fromkeys(sub)))


def _env_server(t: Topology, role: str, inbox: str) -> Permissions:
    """An environment server: the run config and its heartbeats; the endpoints, only in the run's queue group (a
    plain subscription would copy another server's requests); the service's discovery; replies, nothing else."""
    state, workers = t.bucket("state"), t.bucket("workers")
    pub = [*_reads_kv(state), *_reads_kv(workers), f"$KV.{workers}.{role}.>"]
    sub = [inbox, *(f"{subject} {t.env.queue}" for subject in t.env.endpoints()), *t.env.discovery()]
    return Permissions(tuple(pub), tuple(sub), allow_responses=True)


def _reads_kv(bucket: str) -> list[str]:
    """Open a KV bucket and get keys (nats-py uses direct get when the stream allows it)."""
    s = f"KV_{bucket}"
    return [f"{API}.STREAM.INFO.{s}", f"{API}.STREAM.MSG.GET.{s}", f"{API}.DIRECT.GET.{s}", f"{API}.DIRECT.GET.{s}.>"]


def _direct_reader(stream: str) -> list[str]:
    """Read a stream's messages by direct get (`relax_bus.direct_get`), its info and single messages."""
    return [f"{API}.STREAM.INFO.{stream}", f"{API}.STREAM.MSG.GET.{stream}", f"{API}.DIRECT.GET.{stream}"]


def _reads_store(store: str) -> list[str]:
    """Read objects: the info record by subject, the chunks by direct get."""
    return _direct_reader(f"OBJ_{store}")


def _streams(t: Topology) -> list[str]:
    return [
        *(s.name for s in t.streams),
        *(f"KV_{b.name}" for b in t.buckets),
        *(f"OBJ_{o.name}" for o in t.object_stores),
    ]


def _admin(t: Topology, inbox: str) -> Permissions:
    """Everything on the run's own streams (`relax init`, `relax inspect`, `relax run`), nothing beyond."""
    pub = [f"{API}.INFO", f"{API}.STREAM.NAMES", f"{API}.STREAM.LIST"]
    sub = [inbox]
    for s in _streams(t):
        verbs = ("STREAM.*", "STREAM.MSG.*", "DIRECT.GET", "CONSUMER.*")
        pub += [f"{API}.{v}.{s}" for v in verbs] + [f"{API}.{v}.{s}.>" for v in ("DIRECT.GET", "CONSUMER.*")]
        pub += [f"{API}.CONSUMER.DURABLE.CREATE.{s}.*", f"{API}.CONSUMER.MSG.NEXT.{s}.*"]
        pub += [f"$JS.ACK.{s}.>", f"$JS.FC.{s}.>"]
        sub += [f"$JS.EVENT.ADVISORY.*.*.{s}", f"$JS.EVENT.ADVISORY.*.*.{s}.>"]
    pub += [s.subject for s in t.streams]
    pub += [f"$KV.{b.name}.>" for b in t.buckets] + [f"$O.{o.name}.>" for o in t.object_stores]
    return Permissions(tuple(pub), tuple(sub))


def _infos(t: Topology) -> list[str]:
    """The info of every stream and durable consumer of the run (no message, no change)."""
    pub = [f"{API}.STREAM.INFO.{s}" for s in _streams(t)]
    return pub + [f"{API}.CONSUMER.INFO.{t.stream(c.stream_key).name}.{c.durable}" for c in t.consumers]


def _observer(t: Topology, inbox: str) -> Permissions:
    """Look, never touch: what `relax inspect` reads, plus following the events and dead letters."""
    pub = [*_infos(t), t.env.stats]
    for b in t.buckets:
        if b.key != "episodes":  # in-flight episodes' tokens: the rollout's own, no dashboard needs them
            pub += _reads_kv(b.name)
    for key in ("dlq", "events"):
        pub += _direct_reader(t.stream(key).name)
    return Permissions(tuple(dict.fromkeys(pub)), (inbox,))

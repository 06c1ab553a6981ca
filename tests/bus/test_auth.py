"""Per-role credentials (`relax_bus.ops.auth`) against a real nats-server started from the generated config.

A permission violation reaches a client only as a timeout plus an error callback, so every
connection here records its errors: allowed work must leave none, refused work must leave exactly
the violation it provoked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NATS

from relax_bus import blobs
from relax_bus.blobs import BlobStore
from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.errors import CredentialsExist, NatsServerNotFound, NatsUnreachable, PermissionDenied, PublishFailed
from relax_bus.heartbeat import live_workers
from relax_bus.ops.auth import permissions
from relax_bus.ops.credentials import Bundle, write_bundle
from relax_bus.ops.run_report import gather
from relax_bus.ops.server import EmbeddedServer
from relax_bus.outage import through_outage
from relax_bus.policy_version import VersionTracker
from relax_bus.provision import provision
from relax_bus.settings import ConnectionSettings
from relax_bus.topology import build_topology
from relax_bus.worker import Delivery, Worker, WorkerOptions
from schemas import PromptGroup, RolloutGroup
from tests import factories as f
from tests.bus.test_publish import read_all
from tests.conftest import REQUIRE_NATS, run_config
from tests.waiting import until
from workers.config import PipelineConfig
from workers.state_keys import FEEDER_CURSOR, POLICY_VERSION, TRAINER_DONE, TRAINER_STEP

pytestmark = pytest.mark.bus

VIOLATION = "permissions violation"


@dataclass
class Secured:
    """A server started from `relax auth`'s files, and the connections a test opened on it."""

    server: EmbeddedServer
    bundle: Bundle
    config: PipelineConfig
    opened: list[NATS] = field(default_factory=list)
    errors: dict[str, list[str]] = field(default_factory=dict)

    def settings(self, role: str) -> ConnectionSettings:
        """The role's settings as a process gets them: from its credentials file."""
        return ConnectionSettings(_env_file=self.bundle.env_files[role], nats_url=[self.server.url])  # type: ignore[call-arg]

    async def connect(self, role: str, name: str | None = None) -> NATS:
        """A connection as `role` whose server errors land in `self.errors[name or role]`."""
        errors = self.errors.setdefault(name or role, [])
        cred = self.bundle.credentials[role]

        async def record(err: Exception) -> None:
            errors.append(str(err))

        nc = await nats.connect(
            self.server.url,
            user=cred.user,
            password=cred.password,
            inbox_prefix=cred.inbox_prefix,
            error_cb=record,
            max_reconnect_attempts=1,
        )
        self.opened.append(nc)
        return nc

    async def bus(self, role: str, name: str | None = None) -> Bus:
        return await Bus.attach(await self.connect(role, name), self.config.run, PipelineConfig)

    def violations(self, name: str) -> list[str]:
        return [e.lower() for e in self.errors.get(name, []) if VIOLATION in e.lower()]


def violation(kind: str, subject: str) -> str:
    """The error nats-py reports (lower-cased) when the server refuses a publish or subscription."""
    return f'nats: {VIOLATION} for {kind} to "{subject}"'.lower()


def server_from(bundle: Bundle, store_dir: Path) -> EmbeddedServer:
    """A nats-server started from the bundle's config, on a free loopback port and a temp store."""
    try:
        server = EmbeddedServer(config_file=bundle.server_conf, store_dir=store_dir)
    except NatsServerNotFound as err:
        if REQUIRE_NATS:
            pytest.fail(f"nats-server is required here but missing: {err}")
        pytest.skip(str(err))
    return server.start()


@contextlib.asynccontextmanager
async def secured_server(config: PipelineConfig, tmp_path: Path) -> AsyncIterator[Secured]:
    """A server with the per-role users of `config`'s run; every connection opened through it is closed after."""
    # No store dir in the config: EmbeddedServer passes its own (-sd), and a free port (-p).
    bundle = write_bundle(config, tmp_path / "auth", store_dir=None)
    server = server_from(bundle, tmp_path / "nats")
    s = Secured(server, bundle, config)
    try:
        yield s
    finally:
        for nc in s.opened:
            await nc.close()
        server.cleanup()


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[Secured]:
    config = run_config(
        task={"type": "addition", "options": {"seed": 5}},
        trainer={"steps": 2, "checkpoint": {"every": 1}},
        staleness={"max_staleness": 1},
    )
    async with secured_server(config, tmp_path) as s:
        yield s


async def provisioned(s: Secured) -> Bus:
    """Provision the run as the admin, through `connect` and the admin's credentials file."""
    nc = await connect(s.settings("admin"), name="admin")
    s.opened.append(nc)
    await provision(nc.jetstream(timeout=10.0), s.config)
    return await Bus.attach(nc, s.config.run, PipelineConfig)


def test_permissions_follow_the_topology():
    t = build_topology(run_config(run="r1", trainer={"kl": {"coef": 0.1}}))
    rollout, actor, reward = (permissions(t, r) for r in ("rollout", "actor", "reward"))
    assert "relax.r1.rollouts" in rollout.publish and "relax.r1.train" not in rollout.publish
    assert "relax.r1.scored" in reward.publish and "relax.r1.train" not in reward.publish
    assert "$JS.API.CONSUMER.RESET.RELAX_r1_TRAIN.actor" in actor.publish
    assert not any("RESET" in p for p in rollout.publish)
    assert "$KV.relax_r1_state.policy.version" in actor.publish
    # Of the run state, the rollout writes only the held-out evaluation's claims (`workers.roles.evaluation`).
    assert [p for p in rollout.publish if p.startswith("$KV.relax_r1_state.")] == ["$KV.relax_r1_state.eval.claimed"]
    assert "$O.relax_r1_weights.>" in actor.publish and "$O.relax_r1_weights.>" not in rollout.publish
    for role in ("feeder", "rollout", "reward", "reference", "actor", "observer"):
        p = permissions(t, role)
        assert not any(".STREAM.CREATE." in x or ".STREAM.DELETE." in x or "DURABLE" in x for x in p.publish), role
        assert p.subscribe[0] == f"_INBOX.r1-{role}.>"
    assert "$JS.API.STREAM.*.RELAX_r1_PROMPTS" in permissions(t, "admin").publish


def test_the_critic_writes_its_checkpoints_and_state_key_but_not_the_weights():
    t = build_topology(run_config(run="r1", trainer={"advantage": "gae"}, critic={}))
    critic = permissions(t, "critic")
    assert "$O.relax_r1_checkpoints.>" in critic.publish and "$O.relax_r1_weights.>" not in critic.publish
    assert "$KV.relax_r1_state.critic.checkpoint" in critic.publish
    assert "$KV.relax_r1_state.policy.version" not in critic.publish
    assert "$JS.API.CONSUMER.RESET.RELAX_r1_SCORED.critic" in critic.publish
    assert not any("PURGE" in p for p in critic.publish)  # the actor's clear_orphans only
    assert "relax.r1.train" in critic.publish and "relax.r1.train" not in permissions(t, "reward").publish


def test_bundle_files_are_private_and_not_overwritten(tmp_path):
    config = run_config()
    bundle = write_bundle(config, tmp_path / "auth")
    assert set(bundle.env_files) == {"feeder", "rollout", "reward", "actor", "metrics", "admin", "observer"}
    for path in (bundle.server_conf, bundle.auth_conf, *bundle.env_files.values()):
        assert path.stat().st_mode & 0o777 == 0o600, path
    cred = bundle.credentials["rollout"]
    assert cred.password not in bundle.auth_conf.read_text(), "auth.conf holds hashes, never a password"
    env = ConnectionSettings(_env_file=bundle.env_files["rollout"])  # type: ignore[call-arg]
    assert (env.user, env.password, env.inbox_prefix) == (cred.user, cred.password, cred.inbox_prefix)
    with pytest.raises(CredentialsExist, match="--force"):
        write_bundle(config, tmp_path / "auth")
    again = write_bundle(config, tmp_path / "auth", force=True)
    assert again.credentials["rollout"].password != cred.password


async def test_admin_provisions_and_observer_only_looks(secured):
    s = secured
    admin = await provisioned(s)
    report = await provision(admin.js, s.config)
    assert not report.created and not report.updated  # the admin sees everything it made
    observer = await s.connect("observer")
    info = await gather(observer.jetstream(timeout=10.0), s.config.run)
    assert info["run"] == s.config.run and len(info["consumers"]) == 4
    assert s.violations("observer") == []
    with pytest.raises(nats.errors.TimeoutError):
        await observer.jetstream(timeout=1.0).publish(admin.topology.subject("prompts"), b"x")
    assert s.violations("observer") == [violation("publish", admin.topology.subject("prompts"))]
    with pytest.raises(NatsUnreachable, match="Authorization Violation"):
        await connect(s.settings("observer").model_copy(update={"password": "wrong"}))


async def test_rollout_consumes_prompts_reads_weights_and_version_and_beats(secured):
    s = secured
    admin = await provisioned(s)
    feeder = await s.bus("feeder")
    for i in range(3):
        await feeder.publish("prompts", f.prompt(s.config.run, i))
    actor = await s.bus("actor")
    await actor.weights.put("v0", b"weights-of-v0")
    await actor.version.advance(0, 0)

    rollout = await s.bus("rollout")
    tracker = await VersionTracker(rollout.version, poll_s=0.2).start()
    assert await asyncio.wait_for(tracker.wait_for(0), 5) == 0
    beats: list[list[str]] = []

    async def generate(prompt: PromptGroup, delivery: Delivery) -> RolloutGroup:
        assert await rollout.weights.get("v0") == b"weights-of-v0"
        beats.append([b.role for b in await live_workers(admin.workers)])
        return f.rollout(prompt)

    worker = Worker(rollout, "rollout", generate, PromptGroup, WorkerOptions(fetch_timeout_s=0.2))
    counters = await worker.run(until_empty=True)
    await tracker.stop()
    assert counters.processed == 3 and counters.published == 3
    assert sorted(m.prompt.group_id for m in await read_all(admin, "rollouts")) == ["g0", "g1", "g2"]
    assert beats and all(b == ["rollout"] for b in beats)  # its heartbeat was there while it worked
    for role in ("feeder", "actor", "rollout"):
        assert s.errors[role] == [], (role, s.errors[role])


async def test_rollout_cannot_write_what_is_not_its_own(secured, monkeypatch):
    s = secured
    admin = await provisioned(s)
    t = admin.topology
    revision = await (await s.bus("actor")).version.advance(0, 0)
    nc = await s.connect("rollout")
    js = nc.jetstream(timeout=1.0)
    run = s.config.run

    async def refused(operation: Any, subject: str, kind: str = "publish", error: type = nats.errors.TimeoutError):
        before = len(s.violations("rollout"))
        with pytest.raises(error):
            await operation
        assert s.violations("rollout")[before:] == [violation(kind, subject)]

    await refused(js.publish(t.subject("train"), b"x"), t.subject("train"))
    state = await js.key_value(t.bucket("state"))
    # The raw compare-and-set: PolicyVersion.advance would retry a refused write as if NATS were away.
    await refused(state.update(POLICY_VERSION, b"7", last=revision), f"$KV.{t.bucket('state')}.{POLICY_VERSION}")
    monkeypatch.setattr(blobs, "ACK_TIMEOUT_S", 1.0)
    weights = BlobStore(js, t.object_store("weights"), 1 << 20)
    before = len(s.violations("rollout"))
    with pytest.raises(PublishFailed):
        await weights.put("v9", b"not weights")
    assert violation("publish", f"$O.{t.object_store('weights')}.C.")[:-1] in s.violations("rollout")[before]
    assert await admin.weights.info("v9") is None
    prompts = t.stream("prompts").name
    await refused(js.delete_stream(prompts), f"$JS.API.STREAM.DELETE.{prompts}")
    await refused(js.add_consumer(prompts, durable_name="sneaky"), f"$JS.API.CONSUMER.DURABLE.CREATE.{prompts}.sneaky")
    rollouts = t.stream("rollouts").name
    reward_input = await js.pull_subscribe_bind("reward", rollouts)
    await refused(reward_input.fetch(1, timeout=1.0), f"$JS.API.CONSUMER.MSG.NEXT.{rollouts}.reward")
    await refused(
        (await js.key_value(t.bucket("workers"))).put("actor.fake", b"{}"), f"$KV.{t.bucket('workers')}.actor.fake"
    )
    # No consumer of any kind, not even an ephemeral one on a store it reads (`tests/security/test_consumers.py`).
    weights_stream = f"OBJ_{t.object_store('weights')}"
    ask = {"stream_name": weights_stream, "config": {"ack_policy": "none"}}
    create = f"$JS.API.CONSUMER.CREATE.{weights_stream}"
    await refused(nc.request(create, json.dumps(ask).encode(), timeout=1), create)
    other_inbox = f"_INBOX.{run}-actor.>"
    await nc.subscribe(other_inbox)
    await nc.flush()
    # The refusal arrives asynchronously, through the error callback.
    seen = await until(lambda: s.violations("rollout"), lambda v: violation("subscription", other_inbox) in v, 30)
    assert seen[-1] == violation("subscription", other_inbox)
    # Nothing moved: the stream is there, the version is what the actor wrote.
    assert (await admin.js.stream_info(prompts)).config.name == prompts
    assert await admin.version.get() == (0, revision)


class FakeTrainer:
    """The actor's trainer interface without a model: a counter for weights, JSON for checkpoints."""

    vocab_size = 1 << 20  # the fake rollouts' token ids are all inside it
    cfg = SimpleNamespace(warmup=SimpleNamespace(max_steps=0))  # `run_warmup`: no warm-up
    tokenizer = None

    def __init__(self) -> None:
        self.steps = 0
        self.checkpoints = FakeCheckpoints(self)

    def untrainable(self, group: Any) -> str | None:
        from workers.training.batch import untrainable

        return untrainable(group, self.vocab_size)

    def step(self, groups: list[Any], version: int | None = None, media: Any = None) -> dict[str, float]:
        self.steps += 1
        rewards = [r for g in groups for r in g.scored.rewards]
        return {"reward_mean": sum(rewards) / len(rewards), "loss": 0.0}

    def full_state(self) -> dict[str, Any]:
        import torch

        return {"w": torch.full((4,), float(self.steps))}

    def load_full(self, state: dict[str, Any]) -> None:
        self.steps = int(state["w"][0])


class FakeCheckpoints:
    """`TrainerCheckpoints` of a FakeTrainer: its counter and the extra as JSON."""

    def __init__(self, trainer: FakeTrainer) -> None:
        self.trainer = trainer

    def to_bytes(self, extra: dict[str, Any]) -> bytes:
        return self.serialize(self.state(extra))

    def state(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {"steps": self.trainer.steps, "extra": dict(extra)}

    def serialize(self, state: dict[str, Any]) -> bytes:
        return json.dumps(state).encode()

    def restore(self, data: bytes) -> dict[str, Any]:
        saved = json.loads(data)
        self.trainer.steps = saved["steps"]
        return dict(saved["extra"])


async def test_a_tiny_run_under_per_role_credentials(secured):
    """Feeder, rollout (fake generation, real weight and version reads), reward and the actor's loop
    (fake trainer), each on its own connection as its own user; then a restarted actor rewinds."""
    pytest.importorskip("torch")
    from workers.roles.actor import Actor
    from workers.roles.feeder import feed
    from workers.roles.reward import reward_worker
    from workers.weights import ObjectStoreTransport

    s = secured
    admin = await provisioned(s)
    stop = asyncio.Event()
    feeder = await s.bus("feeder")
    feeding = asyncio.create_task(feed(feeder, stop))

    rollout = await s.bus("rollout")
    tracker = await VersionTracker(rollout.version, poll_s=0.2).start()
    transport = ObjectStoreTransport(rollout)

    async def generate(prompt: PromptGroup, delivery: Delivery) -> RolloutGroup:
        version = await tracker.wait_for(0)
        state = await transport.read(version)
        assert float(state["w"][0]) == version
        return f.rollout(prompt, version)

    workers = [
        Worker(rollout, "rollout", generate, PromptGroup, WorkerOptions(fetch_timeout_s=0.2, grace_s=2)),
        reward_worker(await s.bus("reward"), WorkerOptions(fetch_timeout_s=0.2, grace_s=2)),
    ]
    running = [asyncio.create_task(w.run()) for w in workers]
    actor_bus = await s.bus("actor")
    actor = Actor(actor_bus, FakeTrainer(), ObjectStoreTransport(actor_bus))  # type: ignore[arg-type]
    try:
        await actor.setup([])
        assert await asyncio.wait_for(actor.run(stop), 60) == s.config.trainer.steps
        assert await asyncio.wait_for(feeding, 10) >= s.config.trainer.steps * s.config.groups_per_step
    finally:
        stop.set()
        for w in workers:
            w.stop()
        await asyncio.gather(*running, return_exceptions=True)
        await tracker.stop()
        if not feeding.done():
            feeding.cancel()
    assert int((await admin.state.get(TRAINER_STEP)).value or 0) == 2
    assert (await admin.state.get(TRAINER_DONE)).value == b"2"
    assert int((await admin.state.get(FEEDER_CURSOR)).value or 0) >= 4
    assert (await admin.version.get())[0] == 2

    restarted_bus = await s.bus("actor", name="actor-restarted")
    restarted = Actor(restarted_bus, FakeTrainer(), ObjectStoreTransport(restarted_bus))  # type: ignore[arg-type]
    await restarted.setup([])  # resumes from the checkpoint: rewinds the train durable
    assert restarted.state.step == 2
    for name, errors in s.errors.items():
        assert errors == [], (name, errors)


async def test_a_refused_write_fails_at_once_with_the_reason(secured):
    """A refused permission looks like a timeout to nats-py: the bus must not mistake it for an outage."""
    s = secured
    admin = await provisioned(s)
    revision = await (await s.bus("actor")).version.advance(0, 0)
    nc = await connect(s.settings("rollout"), name="rollout")
    s.opened.append(nc)
    rollout = await Bus.attach(nc, s.config.run, PipelineConfig)
    with pytest.raises(PermissionDenied, match="permissions violation"):
        await rollout.version.advance(1, revision)
    with pytest.raises(PermissionDenied, match="permissions violation"):
        await through_outage(lambda: rollout.state.put(TRAINER_STEP, b"9"), "write trainer.step")
    assert await admin.version.get() == (0, revision)

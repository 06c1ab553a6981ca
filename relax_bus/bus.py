"""`Bus`: one connection to one run — its config, topology, publisher, stores and state."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Generic

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from relax_bus.blobs import BlobStore
from relax_bus.connection import connect
from relax_bus.log import get_logger
from relax_bus.outage import through_outage
from relax_bus.policy_version import PolicyVersion
from relax_bus.provision import read_config, state_kv
from relax_bus.publisher import Publisher
from relax_bus.run_state import RunState
from relax_bus.settings import C, ConnectionSettings, RunConfig
from relax_bus.topology import Topology, build_topology
from schemas import Message

log = get_logger(__name__)

JS_TIMEOUT_S = 10.0
"""How long a JetStream request of a role's bus (a publish, a KV put) waits for the server's answer."""


@dataclass
class Bus(Generic[C]):
    """Everything a role needs to talk to its run. `config` is the stored run config read as the
    model the caller names (the bus's own `RunConfig`, or the pipeline's, which extends it)."""

    nc: NATS
    js: JetStreamContext
    config: C
    topology: Topology
    publisher: Publisher
    media: BlobStore
    weights: BlobStore
    checkpoints: BlobStore
    state: KeyValue
    workers: KeyValue
    version: PolicyVersion
    heartbeat_file: Path | None = None
    """Where this process's heartbeat loops also record each beat, for the container's probes (`relax_bus.probe`;
    `relax worker --heartbeat-file`); None: nowhere."""

    @classmethod
    async def connect(
        cls,
        settings: ConnectionSettings,
        run: str,
        *,
        name: str = "relax",
        retry_for_s: float = 0.0,
        config_model: type[C] = RunConfig,  # type: ignore[assignment]
    ) -> Bus[C]:
        """Connect and load the run's config from KV (RunNotFound if `relax init` never ran)."""
        nc = await connect(settings, name=name, retry_for_s=retry_for_s)
        try:
            return await cls.attach(nc, run, config_model)
        except BaseException:
            await nc.close()
            raise

    @classmethod
    async def attach(
        cls,
        nc: NATS,
        run: str,
        config_model: type[C] = RunConfig,  # type: ignore[assignment]
    ) -> Bus[C]:
        """Build a Bus over an existing connection. Its start-up reads ride through an outage or a server too
        loaded to answer in time (`through_outage`), as the connection itself does."""
        js = nc.jetstream(timeout=JS_TIMEOUT_S)
        config = await through_outage(lambda: read_config(js, run, model=config_model), f"read run {run}'s config")
        assert config is not None
        topology = build_topology(config)
        max_payload = int(nc.max_payload or 1 << 20)
        media = BlobStore(js, topology.object_store("media"), max_payload)
        state = await through_outage(lambda: state_kv(js, run), f"open run {run}'s state")
        workers = await through_outage(lambda: js.key_value(topology.bucket("workers")), f"open run {run}'s workers")
        return cls(
            nc=nc,
            js=js,
            config=config,
            topology=topology,
            publisher=Publisher(js, media, min(config.bus.claim_check_bytes, max_payload - 8192)),
            media=media,
            weights=BlobStore(js, topology.object_store("weights"), max_payload),
            checkpoints=BlobStore(js, topology.object_store("checkpoints"), max_payload),
            state=state,
            workers=workers,
            version=PolicyVersion(state),
        )

    @property
    def run(self) -> str:
        return self.config.run

    @property
    def run_state(self) -> RunState:
        """The run's state bucket with reads and writes that ride through NATS outages (`state` is the raw bucket)."""
        return RunState(self.state)

    async def publish(self, subject_key: str, message: Message, msg_id: str | None = None) -> api.PubAck:
        """Publish to one of the run's subjects by key (prompts, rollouts, scored, train, dlq, events)."""
        return await self.publisher.publish(self.topology.subject(subject_key), message, msg_id)

    async def close(self) -> None:
        """Flush and close the connection (pending acks and publishes go out first). Never raises: a connection
        whose server is gone (stopped at the same moment, as `compose down` does) is closed without the flush,
        and what it held unacknowledged is redelivered to another worker."""
        if self.nc.is_closed:
            return
        if self.nc.is_connected:
            try:
                await self.nc.drain()
                return
            except Exception as err:  # tolerated: the connection broke while draining
                log.info("bus_drain_failed", error=type(err).__name__)
        try:
            await self.nc.close()
        except (nats.errors.Error, OSError) as err:  # tolerated: the transport is already gone
            log.info("bus_closed_without_flush", error=type(err).__name__)

    async def __aenter__(self) -> Bus[C]:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

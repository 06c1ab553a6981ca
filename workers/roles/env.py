"""The env role: one instance of the run's environment service (`workers.envs.service`) until stopped.

It serves the run config's `agent.env` (its type and options); a run without an `agent` section has no env role
(`relax worker env` refuses it). The instances of a run share its reset queue group, so scaling is starting more
processes; the rollout's client replays a deterministic environment's episode on another instance when one dies.
Its heartbeat (`env.<instance>`) carries the episodes it opened, the steps it took, the errors and evictions.
"""

from __future__ import annotations

from relax_bus.delivery import WorkerOptions
from relax_bus.log import get_logger
from relax_bus.loop import Loop
from workers.envs.service import ServerLimits, new_instance_id, serve_env
from workers.roles.serve import RoleContext

log = get_logger(__name__)

CALL_SHARE = 0.8
"""An environment call may take this share of `agent.step_timeout_s`: the server's own timeout reply (the episode
fails, `EnvFailed`) reaches the client before the client gives the instance up as lost and replays elsewhere."""


async def serve(ctx: RoleContext) -> None:
    """`relax worker env`: answer the run's environment requests until stopped."""
    bus = ctx.connected
    agent = bus.config.agent
    assert agent is not None, "the role registry puts the env role only in runs with an agent section"
    instance = new_instance_id()
    loop = Loop(bus, ctx.role, WorkerOptions(worker_id=instance))
    limits = ServerLimits(call_timeout_s=agent.step_timeout_s * CALL_SHARE, max_episodes=agent.episodes_per_server)
    server = await serve_env(bus.nc, bus.topology, agent.env.type, agent.env.options, limits=limits, instance=instance)
    loop.counts = server.counts  # the heartbeat reports the server's own counts
    try:
        async with loop.running(stop=ctx.stop):
            await ctx.stop.wait()
    finally:
        await server.stop()

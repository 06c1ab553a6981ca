"""The chaos driver: SIGKILL roles (or the nats-server) at seeded random moments of a real run.

A kill is planned as "once the trainer has finished step s, wait d seconds, SIGKILL, stay down for
t seconds, start again". Roles that exit by themselves (a crash the kill provoked elsewhere) are
restarted too, as `relax run` would, and counted as unplanned exits.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from relax_bus.ops.server import EmbeddedServer
from tests.e2e.cluster import Cluster

SERVER = "nats-server"


@dataclass(frozen=True)
class Kill:
    target: str
    """A role name, or `SERVER`."""
    index: int
    after_step: int
    delay_s: float
    down_s: float


def plan(seed: int, targets: list[tuple[str, int]], steps: int, first: int = 1, margin: int = 3) -> list[Kill]:
    """One kill per target, at distinct random steps in [first, steps - margin], in a random order."""
    rng = random.Random(seed)
    at = sorted(rng.sample(range(first, steps - margin + 1), len(targets)))
    order = rng.sample(targets, len(targets))
    return [
        Kill(name, index, step, round(rng.uniform(0.0, 0.8), 2), round(rng.uniform(0.3, 2.0), 2))
        for (name, index), step in zip(order, at, strict=True)
    ]


@dataclass
class Chaos:
    """Runs a kill plan against a cluster and keeps it supervised until the run ends."""

    cluster: Cluster
    server: EmbeddedServer | None = None
    kills: Counter[str] = field(default_factory=Counter)
    unplanned: Counter[str] = field(default_factory=Counter)
    log: list[str] = field(default_factory=list)

    async def run(self, kills: list[Kill], timeout_s: float = 300.0) -> None:
        """Execute the plan, then wait until the last step, restarting whatever dies on its own."""
        deadline = time.monotonic() + timeout_s
        steps = self.cluster.config.trainer.steps
        pending = list(kills)
        down: dict[tuple[str, int], float] = {}  # killed target -> when to start it again
        while True:
            step = await self._step()
            if step >= steps and not down:
                return
            now = time.monotonic()
            if pending and step >= pending[0].after_step:
                kill = pending.pop(0)
                await asyncio.sleep(kill.delay_s)
                self._kill(kill, step)
                down[(kill.target, kill.index)] = time.monotonic() + kill.down_s
            for key, when in list(down.items()):
                if now >= when:
                    self._start(*key)
                    del down[key]
            self._restart_crashed(down)
            if now >= deadline:
                await self._fail_stuck(step)
            await asyncio.sleep(0.1)

    async def _fail_stuck(self, step: int) -> None:
        """Fail with what a stalled run can tell: the hops still holding messages and every role's stacks."""
        try:
            hops: object = await asyncio.wait_for(self.cluster.stuck(), 5.0)
        except Exception as err:  # tolerated: the report goes out without them
            hops = f"unreadable ({err!r})"
        self.cluster.dump_stacks()
        raise AssertionError(
            f"run stuck at step {step}; hops (pending, unacked): {hops}; chaos log: {self.log}\n"
            f"{self.cluster.all_logs(lines=120)}"
        )

    async def _step(self) -> int:
        if self.server is not None and self.server.proc is None:
            return -1  # the server is down: nothing to read
        try:
            return await asyncio.wait_for(self.cluster.kv_int("trainer.step"), 2.0)
        except Exception:  # tolerated: the server just came back and the client is still reconnecting
            return -1

    def _kill(self, kill: Kill, step: int) -> None:
        self.kills[kill.target] += 1
        self.log.append(f"step {step}: SIGKILL {kill.target}-{kill.index}, down {kill.down_s}s")
        if kill.target == SERVER:
            assert self.server is not None
            self.server.kill()
            return
        role = self.cluster.role(kill.target, kill.index)
        code = role.proc.poll() if role.proc is not None else None
        if code is not None and not role.finished:
            # It died on its own just before the planned kill: that exit stands in for the kill.
            self.unplanned[role.name] += 1
            self.log.append(f"{role.name}-{role.index} had exited with {code} before the kill")
            role.finished = True
            return
        self.cluster.kill(kill.target, kill.index)

    def _start(self, target: str, index: int) -> None:
        if target == SERVER:
            assert self.server is not None
            self.server.start()  # same port, same store directory
        else:
            self.cluster.restart(target, index)

    def _restart_crashed(self, down: dict[tuple[str, int], float]) -> None:
        for role, code in self.cluster.processes.failed():  # a role that ends by itself is marked finished
            if (role.name, role.index) in down:
                continue
            self.unplanned[role.name] += 1
            self.log.append(f"{role.name}-{role.index} exited with {code}: restarted")
            self.cluster.restart(role.name, role.index)

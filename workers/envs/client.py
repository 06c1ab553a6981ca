"""The rollout's side of the environment service (`workers.envs.service`): one `EnvSession` per episode.

`EnvClient.open(item, actions)` sends the reset to the run's queue-group subject (any server instance takes it)
and replays `actions` there, their results discarded (a rollout worker continuing an episode another recorded).
`EnvSession.step(action)` goes to the subject of the instance that holds the episode. When that instance is
lost (no reply within `timeout_s`, no responders, or `unknown episode`), a deterministic environment's episode is
opened again on the reset subject, where another instance answers, with every action taken so far replayed, and
the step is sent again; up to `retries` times, then `EnvLost`. A non-deterministic one raises `EnvLost` at once.
An error reply of the environment itself raises `EnvFailed`. A reset refused by a full instance is asked again
(the queue group picks an instance at random), within the same `retries`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

from relax_bus.log import get_logger
from relax_bus.topology import Topology
from workers.envs.base import EnvItem, StepResult
from workers.envs.errors import EnvFailed, EnvLost
from workers.envs.service import FULL, UNKNOWN_EPISODE, subjects_of

log = get_logger(__name__)


class _Lost(Exception):
    """The instance asked is gone, or does not hold the episode (internal: becomes a replay or `EnvLost`)."""


class EnvClient:
    """Opens episodes on a run's environment service."""

    def __init__(self, nc: NATS, topology_or_run: Topology | str, timeout_s: float = 10.0, retries: int = 2) -> None:
        """`timeout_s`: the longest wait for one reply; `retries`: replacements of a lost instance per step (and
        further resets after a refused or unanswered one)."""
        self.nc = nc
        self.subjects = subjects_of(topology_or_run)
        self.timeout_s = timeout_s
        self.retries = retries

    async def open(self, item: EnvItem, actions: Sequence[str] = ()) -> EnvSession:
        """Start `item`'s episode on any instance and replay `actions` on it (their results discarded)."""
        session = EnvSession(self, item)
        reason = ""
        for attempt in range(self.retries + 1):
            try:
                await session._reset(list(actions))
                session.actions = list(actions)
                return session
            except _Lost as lost:
                reason = str(lost)
                if attempt < self.retries and actions:  # the recorded actions are replayed again, elsewhere
                    session.replays += 1
        raise EnvLost(f"no environment instance took episode {item.episode}: {reason}")

    async def request(self, subject: str, body: dict[str, Any]) -> dict[str, Any]:
        """One request's JSON reply; `_Lost` when no instance answers it, `EnvFailed` for an error reply."""
        try:
            msg = await self.nc.request(subject, json.dumps(body).encode(), timeout=self.timeout_s)
        except nats.errors.NoRespondersError:
            raise _Lost(f"no instance listens on {subject}") from None
        except nats.errors.TimeoutError:
            raise _Lost(f"no reply on {subject} in {self.timeout_s:g}s") from None
        headers = msg.headers or {}
        if ERROR_HEADER in headers:
            code, text = headers.get(ERROR_CODE_HEADER, ""), headers[ERROR_HEADER]
            if code in (UNKNOWN_EPISODE, FULL):
                raise _Lost(f"{text} ({subject})")
            raise EnvFailed(text)
        reply: dict[str, Any] = json.loads(msg.data)
        return reply


class EnvSession:
    """One episode on the environment service."""

    def __init__(self, client: EnvClient, item: EnvItem) -> None:
        self.client = client
        self.item = item
        self.instance = ""
        """The instance that holds the episode now."""
        self.observation = ""
        """The first observation (the reset's)."""
        self.deterministic = False
        self.actions: list[str] = []
        """The actions taken so far (replayed, in order, on a replacement instance)."""
        self.replays = 0
        """Times the episode was replayed on another instance after its own was lost."""

    @property
    def episode(self) -> str:
        return self.item.episode

    async def step(self, action: str) -> StepResult:
        """Take `action`; `EnvLost` when the episode's instance is lost beyond replay, `EnvFailed` on an error."""
        subjects, client = self.client.subjects, self.client
        reason = ""
        for attempt in range(client.retries + 1):
            try:
                if attempt:
                    await self._reset(self.actions)
                    self.replays += 1
                    log.info("env_replayed", episode=self.episode, instance=self.instance, actions=len(self.actions))
                reply = await client.request(subjects.step(self.instance), {"episode": self.episode, "action": action})
            except _Lost as lost:
                if not self.deterministic:
                    raise EnvLost(f"{lost}; the environment is not deterministic: no replay") from None
                reason = str(lost)
                continue
            self.actions.append(action)
            return StepResult(
                observation=str(reply["observation"]),
                reward=None if reply.get("reward") is None else float(reply["reward"]),
                done=bool(reply.get("done", False)),
                info=dict(reply.get("info") or {}),
            )
        raise EnvLost(f"{reason}; {client.retries} replays spent")

    async def close(self) -> None:
        """Tell the instance the episode is over (best effort: an instance gone or slow forgets it by itself)."""
        if not self.instance:
            return
        try:
            await self.client.request(self.client.subjects.close(self.instance), {"episode": self.episode})
        except (_Lost, EnvFailed, nats.errors.Error) as err:  # tolerated: the server's idle TTL drops it
            log.debug("env_close_lost", episode=self.episode, error=str(err))

    async def _reset(self, actions: list[str]) -> None:
        """Open the episode on whichever instance the queue group picks, and replay `actions` there."""
        reply = await self.client.request(
            self.client.subjects.reset, {"episode": self.episode, "item": asdict(self.item)}
        )
        self.instance = str(reply["instance"])
        self.observation = str(reply["observation"])
        self.deterministic = bool(reply["deterministic"])
        if actions and not self.deterministic:
            await self.close()
            raise EnvLost("the environment is not deterministic: its recorded actions cannot be replayed")
        step = self.client.subjects.step(self.instance)
        for action in actions:
            await self.client.request(step, {"episode": self.episode, "action": action})

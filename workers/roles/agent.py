"""The rollout role's agent: each sample of a group as a multi-turn episode (`agent` in the run config).

It owns what the episodes of one rollout worker share: the tool-call format, the limits, the client of the run's
environment service and the episodes bucket. A group's episode j is `<group>/<attempt>/<j>`; after every completed
turn its record is put in the bucket under a key derived from that id, and deleted once the group is generated. A
worker that takes over a group (its first worker died mid-episode) reads the records first and resumes each
episode from its last completed turn: the environment is reset and the recorded actions replayed
(`workers.envs.client`), and the recorded tokens are prefilled with their versions kept
(`workers.roles.episodes`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from relax_bus.bus import Bus
from relax_bus.log import get_logger
from schemas import PromptGroup, Sample
from workers.data.tasks import prompt_text
from workers.engines.base import Engine, SamplingSettings
from workers.envs.base import EnvItem
from workers.envs.client import EnvClient
from workers.envs.formats import ToolFormat, make_format
from workers.roles.episodes import EnvSessionLike, EpisodeRecord, Limits, group_version, run_episodes

log = get_logger(__name__)


def episode_id(prompt: PromptGroup, sample: int) -> str:
    """`<group>/<attempt>/<sample>`: one episode of a group's attempt."""
    return f"{prompt.group_id}/{prompt.attempt}/{sample}"


def record_key(run: str, episode: str) -> str:
    """The episodes bucket's key of an episode's record (a digest: group ids may hold characters keys may not)."""
    return hashlib.blake2b(f"{run}/{episode}".encode(), digest_size=16).hexdigest()


class Agent:
    """Runs the samples of prompt groups as episodes against the run's environment service."""

    def __init__(
        self, bus: Bus, engine: Engine, fmt: ToolFormat, sampling: SamplingSettings, client: EnvClient, kv: KeyValue
    ) -> None:
        cfg = bus.config.agent
        assert cfg is not None
        self.bus = bus
        self.engine = engine
        self.format = fmt
        self.sampling = sampling
        self.client = client
        self.kv = kv
        self.record_turns = cfg.record_turns
        self.limits = Limits(
            max_turns=cfg.max_turns,
            max_tokens=cfg.max_tokens,
            turn_tokens=sampling.max_new_tokens,
            max_observation_chars=cfg.max_observation_chars,
        )

    @classmethod
    async def start(cls, bus: Bus, engine: Engine, tokenizer: Any, sampling: SamplingSettings) -> Agent:
        """The agent of a run with an `agent` section (ValueError for a format the tokenizer cannot serve)."""
        cfg = bus.config.agent
        assert cfg is not None
        fmt = make_format(cfg.format, tokenizer)
        client = EnvClient(bus.nc, bus.topology, timeout_s=cfg.step_timeout_s, retries=cfg.env_retries)
        kv = await bus.js.key_value(bus.topology.bucket("episodes"))
        return cls(bus, engine, fmt, sampling, client, kv)

    async def groups(
        self,
        prompts: Sequence[PromptGroup],
        ids: Sequence[list[int]],
        n: int,
        seeds: Sequence[int] | None,
        current: int,
    ) -> list[tuple[int, tuple[Sample, ...]]]:
        """Every group's episodes, one per sample: (group version, samples) per prompt group, in order."""
        rows_prompt, items, row_seeds = [], [], []
        for g, (prompt, prompt_ids) in enumerate(zip(prompts, ids, strict=True)):
            text = prompt_text(prompt.parts)
            for j in range(n):
                episode = episode_id(prompt, j)
                seed = None if seeds is None else seeds[g] + j
                rows_prompt.append(prompt_ids)
                row_seeds.append(seed)
                items.append(
                    EnvItem(
                        episode=episode,
                        prompt=text,
                        answer=prompt.answer,
                        metadata=dict(prompt.metadata),
                        seed=seed if seed is not None else 0,
                    )
                )
        resumed = await asyncio.gather(*(self._recorded(it.episode) for it in items))
        if taken := sum(r is not None for r in resumed):
            log.info("episodes_resumed", episodes=taken, turns=sum(r.turns for r in resumed if r is not None))
        samples = await run_episodes(
            self.engine,
            self.format,
            self.sampling,
            self.limits,
            rows_prompt,
            items,
            row_seeds,
            self._open,
            resumed,
            self._record if self.record_turns else None,
        )
        if self.record_turns:
            await asyncio.gather(*(self._forget(it.episode) for it in items))
        return [group_version(samples[g * n : (g + 1) * n], current) for g in range(len(prompts))]

    async def _open(self, item: EnvItem, actions: Sequence[str]) -> EnvSessionLike:
        session: EnvSessionLike = await self.client.open(item, actions)
        return session

    async def _record(self, record: EpisodeRecord) -> None:
        await self.kv.put(record_key(self.bus.run, record.episode), record.to_bytes())

    async def _recorded(self, episode: str) -> EpisodeRecord | None:
        if not self.record_turns:
            return None
        try:
            entry = await self.kv.get(record_key(self.bus.run, episode))
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        try:
            return EpisodeRecord.from_bytes(entry.value)
        except (ValueError, TypeError) as err:  # deliberate: a record that cannot be read restarts its episode
            log.warning("episode_record_unreadable", episode=episode, error=f"{type(err).__name__}: {err}")
            return None

    async def _forget(self, episode: str) -> None:
        try:
            await self.kv.purge(record_key(self.bus.run, episode))
        except Exception as err:  # tolerated: the bucket's age bound drops it later
            log.debug("episode_record_not_purged", episode=episode, error=f"{type(err).__name__}: {err}")

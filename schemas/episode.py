"""How a multi-turn episode went: the record a sample that is an episode carries (`Sample.episode`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EpisodeEnd = Literal["answer", "env_done", "max_turns", "max_tokens", "env_error", "env_lost"]
"""Why an episode ended: the policy answered (a turn without a tool call), the environment said done, a limit
(`agent.max_turns`, `agent.max_tokens`: truncated), or the environment failed (an error it raised, or every
instance that could serve it was lost)."""
TRUNCATED: frozenset[str] = frozenset({"max_turns", "max_tokens"})


class EpisodeInfo(BaseModel):
    """How a multi-turn episode went (`Sample.episode`)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    turns: int = Field(ge=0)
    """Policy turns generated."""
    tool_calls: int = Field(default=0, ge=0)
    """Turns that called the environment."""
    invalid_calls: int = Field(default=0, ge=0)
    """Calls the environment answered as invalid (`info.valid` false)."""
    ended: EpisodeEnd
    answer: str = ""
    """The final answer: the text of the last policy turn when it called no tool, else empty."""
    env_reward: float | None = Field(default=None, allow_inf_nan=False)
    """Sum of the environment's step rewards; None when no step gave one."""
    env_errors: int = Field(default=0, ge=0)
    """Environment failures met (errors raised, instances lost)."""
    replays: int = Field(default=0, ge=0)
    """Times the episode was replayed on another environment instance."""
    resumed_turns: int = Field(default=0, ge=0)
    """Policy turns taken over from the record of another rollout worker (the episode resumed mid-way)."""
    env_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """Seconds spent waiting for the environment."""

    @property
    def truncated(self) -> bool:
        """Whether a limit ended it."""
        return self.ended in TRUNCATED

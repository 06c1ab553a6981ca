"""The agent section: multi-turn episodes with an environment served on the bus (docs/agentic.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from workers.config.base import Section


class EnvSpec(Section):
    """Which environment class the `env` role serves."""

    type: str = Field(min_length=1)
    """A built-in environment (`calculator`, `guess_number`, `python`) or `module:Class` of your own."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the class's constructor."""


class AgentConfig(Section):
    """Multi-turn episodes: policy turns interleaved with an environment's observations (never trained)."""

    env: EnvSpec
    """The episodes' environment, served by the `env` role's processes (`roles: {env: N}`, 1 by default)."""
    format: Literal["tags", "hermes"] = "tags"
    """How a policy turn calls a tool and how an observation is appended: `tags` is `<call>...</call>` then
    `<obs>...</obs>` in raw text (the tiny model); `hermes` is `<tool_call>{json}</tool_call>` with observations
    as `tool` messages through the model's chat template (Qwen, SmolLM2 and other chat models)."""
    max_turns: int = Field(default=4, ge=1, le=64)
    """Most policy turns in one episode; an episode still calling a tool after them ends `max_turns`
    (truncated: flagged, and scored as the rewards say)."""
    max_tokens: int = Field(default=64, ge=2)
    """Most tokens of one episode after its prompt (policy and observation tokens together); a turn gets at most
    `rollout.max_new_tokens` and never more than what is left of this."""
    step_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    """Longest wait for one environment reply before the instance counts as lost."""
    env_retries: int = Field(default=2, ge=0, le=10)
    """Times a lost environment instance is replaced (a deterministic environment's episode is replayed on
    another instance from its recorded actions) before the episode ends `env_lost`."""
    episodes_per_server: int = Field(default=1024, ge=1, le=1_000_000)
    """Episodes one environment server process holds at once; a further reset goes to another server (a rollout
    worker keeps `rollout.batch_groups x samples_per_group` episodes in flight: give the env role enough
    processes, `roles: {env: N}`, that N x this covers every rollout worker's)."""
    max_observation_chars: int = Field(default=512, ge=1)
    """Observations longer than this are cut (and flagged in the turn's info)."""
    reward: Literal["rule", "env", "sum"] = "rule"
    """What an episode's reward is: the run's reward functions on the final answer (`rule`), the sum of the
    environment's step rewards (`env`), or both added (`sum`)."""
    record_turns: bool = True
    """Record every completed turn on the bus (the run's episodes bucket), so an episode whose rollout worker
    dies continues on another from its last recorded turn."""

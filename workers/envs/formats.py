"""Tool-call formats: how a policy turn calls a tool, and how the observation is appended after it.

A format reads the text of one policy turn (the engine stops the turn at the format's stop string) and returns
the call's action, or None for a turn without a call (the episode's final answer). It renders an observation as
the token ids the rollout appends after the turn: those ids are context, never trained, and the trainer sees them
exactly as appended (the conversation is never re-rendered or re-tokenised as a whole).

    tags     the tiny model's own format in raw text: `<call>37*45</call>` then `<obs>1665</obs>`, then the policy
             goes on in the same turn of text
    hermes   chat models (Qwen, Hermes, SmolLM2): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` inside
             the assistant's turn; the observation is the end of that turn, a `tool` message and the start of the
             next assistant turn, all rendered by the model's own chat template
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from workers.config.agent import AgentConfig
from workers.data.prompts import uses_chat
from workers.envs.base import env_class, tools_of


class ToolFormat(Protocol):
    """How one model family calls tools."""

    name: str
    stop: tuple[str, ...]
    """Strings that end a policy turn that calls a tool."""

    def call_of(self, text: str) -> str | None:
        """The action a turn's text calls, or None when it calls nothing (a final answer)."""
        ...

    def observation_ids(self, text: str) -> list[int]:
        """The token ids appended after a call: the observation `text` as this format renders it."""
        ...

    def opening_ids(self, text: str) -> list[int]:
        """The token ids appended after the prompt for an environment's first observation (its `reset` text)."""
        ...


class TagFormat:
    """`<call>ACTION</call>` in the policy's text; `<obs>TEXT</obs>` appended after it."""

    name = "tags"
    stop = ("</call>",)
    _call = re.compile(r"<call>(.*?)</call>", re.DOTALL)

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def call_of(self, text: str) -> str | None:
        found = self._call.search(text)
        return None if found is None else found.group(1).strip()

    def observation_ids(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(f"<obs>{text}</obs>", add_special_tokens=False)]

    def opening_ids(self, text: str) -> list[int]:
        return self.observation_ids(text)


class HermesFormat:
    """`<tool_call>{json}</tool_call>` in an assistant turn; the observation as a `tool` message of the chat template.

    The observation's ids are the chat template's rendering of a conversation that ends with the tool message and
    the generation prompt, from just after the assistant's text: `<|im_end|>\\n<|im_start|>tool\\n...` in ChatML.
    """

    name = "hermes"
    stop = ("</tool_call>",)
    _call = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
    _marker = "\u2063RELAX-TURN-END\u2063"

    def __init__(self, tokenizer: Any) -> None:
        if not uses_chat(tokenizer, "auto"):
            raise ValueError("agent.format hermes needs a tokenizer with a chat template (use tags for a raw model)")
        self.tokenizer = tokenizer
        self._check_template()

    def call_of(self, text: str) -> str | None:
        found = self._call.search(text)
        return None if found is None else found.group(1).strip()

    def observation_ids(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(self._after_turn(text), add_special_tokens=False)]

    def opening_ids(self, text: str) -> list[int]:
        """The first observation as the start of the assistant's turn (the prompt ends with the generation prompt)."""
        return [int(i) for i in self.tokenizer.encode(f"{text}\n", add_special_tokens=False)]

    def _after_turn(self, observation: str) -> str:
        """The template's text after an assistant turn up to the next assistant turn's start, with `observation`
        as a tool message between them."""
        messages = [
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": self._marker},
            {"role": "tool", "content": observation},
        ]
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        _, found, tail = str(rendered).partition(self._marker)
        if not found:
            raise ValueError("the chat template drops the assistant's text: it cannot render tool calls")
        return tail

    def _check_template(self) -> None:
        """Refuse a template that cannot render a tool message after an assistant turn."""
        try:
            tail = self._after_turn("42")
        except Exception as err:  # deliberate: any template failure is a config error, said in one line
            raise ValueError(f"agent.format hermes: the chat template cannot render a tool message: {err}") from None
        if "42" not in tail:
            raise ValueError("agent.format hermes: the chat template leaves out tool messages")


FORMATS: dict[str, type[TagFormat] | type[HermesFormat]] = {"tags": TagFormat, "hermes": HermesFormat}


def make_format(name: str, tokenizer: Any) -> ToolFormat:
    """The tool-call format `agent.format` names, for `tokenizer`."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(sorted(FORMATS))}")
    fmt: ToolFormat = FORMATS[name](tokenizer)
    return fmt


def prompt_tools(agent: AgentConfig | None) -> list[dict[str, Any]] | None:
    """The tool descriptions a run's prompts render with (`prompt_ids(tools=...)`): the environment class's `tools`
    when the agent calls them through the chat template (`hermes`), else None. The rollout role and the trainer's
    warm-up both ask here, so they render the same ids."""
    if agent is None or agent.format != "hermes":
        return None
    return tools_of(env_class(agent.env.type)) or None

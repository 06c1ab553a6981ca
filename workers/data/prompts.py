"""A prompt's text as the token ids the model reads, and an answer's ids for supervised warm-up.

    model.prompt_format   auto   the tokenizer's chat template when it has one, raw text otherwise
                          chat   the chat template (refused when the tokenizer has none)
                          raw    the text itself, after the tokenizer's BOS when it has one

Chat: `[system?] + history + user(text)` through `apply_chat_template(add_generation_prompt=True)`, so the
ids end where the assistant's turn begins and the model answers in its own format (a template's own default
system prompt applies when `model.system_prompt` is unset; a conversation's own system turn replaces it).
A run whose agent calls tools through the chat template (`agent.format: hermes`) passes the environment's tool
descriptions as `tools`, which the template renders as its model expects (a template that ignores them, like
SmolLM2's, renders the same ids as without).
Raw: the system prompt, the earlier turns' texts and the text, joined by blank lines (`tools` is not rendered).
A tokenizer without BOS (Qwen-family) adds none; no `None` ever reaches the ids.
The rollout role and the trainer's warm-up both render through here, so they see the same ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from schemas import ChatTurn

FORMATS = ("auto", "chat", "raw")


def uses_chat(tokenizer: Any, prompt_format: str) -> bool:
    """Whether prompts go through the chat template; ValueError for `chat` without a template."""
    if prompt_format not in FORMATS:
        raise ValueError(f"unknown prompt format {prompt_format!r}; valid: {list(FORMATS)}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt_format == "chat" and not has_template:
        raise ValueError(
            "model.prompt_format is 'chat' but the model's tokenizer has no chat template "
            "(use 'raw' for a base model, or add chat_template.jinja to the model directory)"
        )
    return prompt_format == "chat" or (prompt_format == "auto" and has_template)


def prompt_ids(
    tokenizer: Any,
    text: str,
    prompt_format: str = "auto",
    system: str | None = None,
    history: Sequence[ChatTurn] = (),
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a user prompt after the conversation's earlier turns, ready for generation; ValueError when
    it renders to nothing. `tools`: JSON-schema tool descriptions for the chat template (None: none)."""
    if history and history[-1].role == "user":
        raise ValueError("a conversation's history must not end with a user turn: the prompt is the user's turn")
    if any(t.role == "system" for t in history):
        system = None  # the conversation's own system turn replaces the configured one
    if uses_chat(tokenizer, prompt_format):
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": t.role, "content": t.content} for t in history]
        messages.append({"role": "user", "content": text})
        extra = {"tools": [dict(t) for t in tools]} if tools else {}
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **extra
        )
        ids = list(rendered["input_ids"] if isinstance(rendered, dict) else rendered)
    else:
        full = "\n\n".join([*([system] if system else []), *(t.content for t in history), text])
        ids = list(tokenizer.encode(full, add_special_tokens=False))
        bos = tokenizer.bos_token_id
        if bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
    if not ids:
        raise ValueError("the prompt renders to no tokens (empty text, and the tokenizer has no BOS)")
    return [int(i) for i in ids]


def answer_ids(tokenizer: Any, answer: str) -> list[int]:
    """The ids of a reference answer as the model should produce it: the text, then EOS (the end of turn)."""
    ids = [int(i) for i in tokenizer.encode(answer, add_special_tokens=False)]
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer names no EOS token, so an answer has no end")
    return [*ids, int(eos)]

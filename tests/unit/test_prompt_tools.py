"""Prompts with tools: `prompt_ids(tools=...)` hands the tool descriptions to the chat template, and a run whose
agent calls tools through the chat template (`agent.format: hermes`) renders its prompts with its environment's
tools in the rollout role and in the trainer's warm-up alike, so both see the same ids.

A template that renders tools (a small one on the byte tokenizer) shows they reach it; SmolLM2-135M-Instruct's,
which ignores them, from the model directory `make smollm2` writes: skipped on a machine without it, failed in CI
(CI=true), as in tests/unit/test_tool_formats.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from schemas import PromptGroup, TextPart
from workers.config import PipelineConfig, parse_config
from workers.data.prompts import prompt_ids
from workers.data.tasks import TaskItem
from workers.data.tokenizer import build_byte_tokenizer
from workers.envs.base import env_class, tools_of
from workers.envs.formats import HermesFormat, prompt_tools
from workers.roles.rollout import Rollout
from workers.training.supervised import item_prompt

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"
IN_CI = os.environ.get("CI", "").lower() == "true"
QUESTION = "What is 37*45? Use the calculator tool."
SYSTEM = 'Example: <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
# A chat template that writes the names of the tools it is given before the conversation.
TOOLS_TEMPLATE = (
    "{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def tools_tokenizer() -> Any:
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def smollm2() -> Any:
    """SmolLM2's tokenizer, as the engines load it."""
    if not SMOLLM2.is_dir():
        if IN_CI:
            pytest.fail(f"{SMOLLM2} is missing: `make smollm2` builds it before the tests")
        pytest.skip(f"{SMOLLM2} is missing (`make smollm2`)")
    from workers.data.models import load_tokenizer

    return load_tokenizer(SMOLLM2)


def agent_config(fmt: str | None) -> PipelineConfig:
    """A run on the arithmetic task with the calculator through `fmt` (None: no agent)."""
    data: dict[str, Any] = {
        "run": "tools",
        "model": {"source": "tiny", "system_prompt": SYSTEM},
        "task": {"type": "arithmetic", "options": {"template": "What is {a}{op}{b}? Use the calculator tool."}},
    }
    if fmt is not None:
        data["agent"] = {"env": {"type": "calculator"}, "format": fmt}
    return parse_config(data)


def rollout_ids(config: PipelineConfig, tokenizer: Any, text: str) -> list[int]:
    """The ids the rollout role's worker renders a prompt group's text as (no bus: its config is all it reads)."""
    bus = SimpleNamespace(config=config, version=None, media=None)
    engine = SimpleNamespace(max_context=None, processor=None)
    rollout = Rollout(bus, engine, tokenizer, transport=None, worker_id="w0")  # type: ignore[arg-type]
    group = PromptGroup(
        run="tools", group_id="g0", parts=(TextPart(text=text),), n_samples=1, release_index=0, released_at_version=0
    )
    return rollout._encode(group)


def warmup_ids(config: PipelineConfig, tokenizer: Any, text: str) -> list[int]:
    """The ids the trainer's warm-up renders a task item's prompt as."""
    trainer = SimpleNamespace(config=config, tokenizer=tokenizer, prompter=None)
    item = TaskItem(parts=(TextPart(text=text),), answer="1665", task="arithmetic", index=0)
    ids, media = item_prompt(trainer, item)  # type: ignore[arg-type]
    assert media is None
    return ids


def test_prompt_ids_hand_the_tools_to_the_chat_template(tools_tokenizer):
    tools = tools_of(env_class("calculator"))
    with_tools = tools_tokenizer.decode(prompt_ids(tools_tokenizer, QUESTION, "chat", tools=tools))
    assert with_tools == f"tools: calculator\nuser: {QUESTION}\nassistant: "
    assert tools_tokenizer.decode(prompt_ids(tools_tokenizer, QUESTION, "chat")) == f"user: {QUESTION}\nassistant: "
    # An empty list is no tools; raw text never renders them.
    assert prompt_ids(tools_tokenizer, QUESTION, "chat", tools=[]) == prompt_ids(tools_tokenizer, QUESTION, "chat")
    assert prompt_ids(tools_tokenizer, QUESTION, "raw", tools=tools) == prompt_ids(tools_tokenizer, QUESTION, "raw")


def test_only_a_hermes_agent_renders_its_environments_tools():
    assert prompt_tools(agent_config("hermes").agent) == tools_of(env_class("calculator"))
    assert prompt_tools(agent_config("tags").agent) is None
    assert prompt_tools(agent_config(None).agent) is None


@pytest.mark.parametrize("fmt", ["hermes", "tags", None])
def test_rollout_and_warmup_render_the_same_ids(tools_tokenizer, fmt):
    config = agent_config(fmt)
    rolled = rollout_ids(config, tools_tokenizer, QUESTION)
    assert rolled == warmup_ids(config, tools_tokenizer, QUESTION)
    rendered = tools_tokenizer.decode(rolled)
    assert rendered.startswith("tools: calculator\n") == (fmt == "hermes"), rendered
    assert rendered.endswith(f"system: {SYSTEM}\nuser: {QUESTION}\nassistant: "), rendered


def test_smollm2_renders_a_prompt_with_tools(smollm2):
    tools = tools_of(env_class("calculator"))
    ids = prompt_ids(smollm2, QUESTION, "auto", SYSTEM, tools=tools)
    text = smollm2.decode(ids)
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    # SmolLM2's template ignores the tools: the ids are those without them.
    assert ids == prompt_ids(smollm2, QUESTION, "auto", SYSTEM)
    HermesFormat(smollm2)  # and its template takes the tool messages of a hermes agent


def test_smollm2_rollout_and_warmup_render_the_same_ids(smollm2):
    config = agent_config("hermes")
    rolled = rollout_ids(config, smollm2, QUESTION)
    assert rolled == warmup_ids(config, smollm2, QUESTION)
    assert rolled == prompt_ids(smollm2, QUESTION, "auto", SYSTEM)

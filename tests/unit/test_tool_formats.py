"""Tool-call formats (`workers.envs.formats`): reading a turn's call, and the ids an observation is appended as.

`tags` runs on the byte tokenizer. `hermes` runs on SmolLM2-135M-Instruct's tokenizer and chat template, from the
model directory `make smollm2` writes (`models/SmolLM2-135M-Instruct` at the repository root, as the real-model
e2e test finds it): skipped on a machine without it, failed in CI (CI=true), where `make test` builds it first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from schemas import EpisodeInfo, PromptGroup, RolloutGroup, Sample, ScoredGroup, TextPart, TrainGroup, WireTensor
from workers.data.prompts import prompt_ids
from workers.data.tokenizer import build_byte_tokenizer
from workers.envs.formats import HermesFormat, TagFormat, make_format
from workers.training.batch import make_batch

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"
IN_CI = os.environ.get("CI", "").lower() == "true"
CALL = '{"name": "calculator", "arguments": {"expression": "37*45"}}'


@pytest.fixture(scope="module")
def byte_tokenizer() -> Any:
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def smollm2() -> Any:
    """SmolLM2's tokenizer, as the engines load it."""
    if not SMOLLM2.is_dir():
        if IN_CI:
            pytest.fail(f"{SMOLLM2} is missing: `make smollm2` builds it before the tests")
        pytest.skip(f"{SMOLLM2} is missing (`make smollm2`)")
    from workers.data.models import load_tokenizer

    return load_tokenizer(SMOLLM2)


# ---- tags ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("1665", None),  # an answer: no call
        ("", None),
        ("<call>37*45", None),  # never closed: no call
        ("37*45</call>", None),
        ("<call>37*45</call>", "37*45"),
        ("<call>  37 * 45 \n</call>", "37 * 45"),  # spaces around the action dropped, inside it kept
        ("let me compute <call>12+30</call> then", "12+30"),
        ("<call>a <b>bold</b> x<y</call>", "a <b>bold</b> x<y"),  # other tags inside the call are its text
        ("<call>1\n+\n2</call>", "1\n+\n2"),
        ("<call>1+2</call><call>3+4</call>", "1+2"),  # the first call of a turn
        ("<call></call>", ""),  # an empty call is a call: the environment answers it
    ],
)
def test_tag_format_reads_the_call_of_a_turn(byte_tokenizer, text, action):
    assert TagFormat(byte_tokenizer).call_of(text) == action


@pytest.mark.parametrize("observation", ["1665", "", "héllo wörld", "<obs>nested</obs>", "line\nbreak"])
def test_tag_format_appends_an_observation_as_its_bytes_in_obs_tags(byte_tokenizer, observation):
    fmt = TagFormat(byte_tokenizer)
    ids = fmt.observation_ids(observation)
    assert ids == list(f"<obs>{observation}</obs>".encode())  # no bos, no eos: context inside the turn
    assert byte_tokenizer.decode(ids) == f"<obs>{observation}</obs>"
    assert fmt.opening_ids(observation) == ids
    assert all(isinstance(i, int) for i in ids)


def test_tag_format_stops_a_turn_at_its_closing_tag_and_is_registered(byte_tokenizer):
    fmt = make_format("tags", byte_tokenizer)
    assert isinstance(fmt, TagFormat) and fmt.stop == ("</call>",)
    with pytest.raises(ValueError, match="unknown tool-call format 'json'"):
        make_format("json", byte_tokenizer)


def test_hermes_format_refuses_a_tokenizer_without_a_chat_template(byte_tokenizer):
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        HermesFormat(byte_tokenizer)


# ---- hermes on SmolLM2 --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "action"),
    [
        (f"<tool_call>\n{CALL}\n</tool_call>", CALL),
        (f"I will use the calculator.<tool_call>{CALL}</tool_call>", CALL),
        ("The answer is 1665.", None),
        (f"<tool_call>{CALL}", None),
    ],
)
def test_hermes_format_reads_the_json_of_a_call(smollm2, text, action):
    fmt = HermesFormat(smollm2)
    assert fmt.call_of(text) == action
    if action is not None:
        assert json.loads(action) == {"name": "calculator", "arguments": {"expression": "37*45"}}


def test_hermes_observation_ends_the_turn_with_a_tool_message_and_opens_the_next(smollm2):
    fmt = make_format("hermes", smollm2)
    assert fmt.stop == ("</tool_call>",)
    ids = fmt.observation_ids("1665")
    assert smollm2.decode(ids) == "<|im_end|>\n<|im_start|>tool\n1665<|im_end|>\n<|im_start|>assistant\n"
    # The turn's end and the roles are the template's special tokens, not their spelling in text.
    im_start, im_end = smollm2.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[0] == im_end and ids.count(im_start) == 2 and ids.count(im_end) == 2
    assert smollm2.decode(fmt.opening_ids("Go.")) == "Go.\n"


def test_a_hermes_episode_trains_on_the_ids_appended_not_on_a_retokenised_conversation(smollm2):
    """An engine may sample a text in pieces its tokenizer would not choose (here `answer` spelled letter by
    letter): re-tokenising the decoded episode gives other ids, so the trainer must get the appended ones."""
    tok, fmt = smollm2, HermesFormat(smollm2)
    prompt = prompt_ids(tok, "What is 37*45?")
    call = tok.encode(f"<tool_call>\n{CALL}\n</tool_call>", add_special_tokens=False)
    observation = fmt.observation_ids("1665")
    spelled = [i for ch in "The answer" for i in tok.encode(ch, add_special_tokens=False)]
    answer = spelled + tok.encode(" is 1665.", add_special_tokens=False) + [tok.eos_token_id]
    episode = call + observation + answer
    trained = [1] * len(call) + [0] * len(observation) + [1] * len(answer)
    assert tok.decode(spelled) == "The answer" and spelled != tok.encode("The answer", add_special_tokens=False)
    retokenised = tok.encode(tok.decode(prompt + episode), add_special_tokens=False)
    assert retokenised != prompt + episode
    sample = Sample(
        token_ids=WireTensor.from_values(episode, "int32"),
        logprobs=WireTensor.from_values([-0.5 if t else 0.0 for t in trained], "float32"),
        loss_mask=WireTensor.from_values(trained, "uint8"),
        episode=EpisodeInfo(turns=2, tool_calls=1, ended="answer", answer="The answer is 1665."),
    )
    group = PromptGroup(
        run="t", group_id="g0", parts=(TextPart(text="What is 37*45?"),), n_samples=1, release_index=0,
        released_at_version=0,
    )  # fmt: skip
    rollout = RolloutGroup(
        prompt=group, prompt_token_ids=WireTensor.from_values(prompt, "int32"), samples=(sample,), policy_version=0
    )
    batch = make_batch([TrainGroup(scored=ScoredGroup(rollout=rollout, rewards=(1.0,)))])
    assert batch.ids[0].tolist() == prompt + episode
    p = len(prompt)
    assert batch.mask[0, : p - 1].tolist() == [0.0] * (p - 1)
    assert batch.mask[0, p - 1 :].tolist() == [float(t) for t in trained]

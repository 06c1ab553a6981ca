"""The prompt-shared forward gives the plain pass's log-probs and gradients, in the trainer and alone."""

from __future__ import annotations

import pytest
import torch

from tests.workers.test_microbatch import gradients, setup  # noqa: F401 - `setup` is a fixture used here
from workers.data.models import load_model, materialize
from workers.training.logprobs import token_logprobs
from workers.training.microbatch import pack_groups
from workers.training.shared_prompt import grouped_logprobs, place

pytestmark = pytest.mark.workers

# Two prompts of different lengths, responses of 1..6 tokens (one of them a single token).
PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 51, 52, 53, 54, 55, 56, 57]]
RESPONSES = [[60, 61, 62], [63], [64, 65, 66, 67], [70, 71], [72, 73, 74, 75, 76, 77]]
PROMPT_OF = [0, 0, 0, 1, 1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return materialize("tiny:64x2", tmp_path_factory.mktemp("m") / "m", seed=3)


def _plain(model, temperature):
    """token_logprobs over prompt + response rows, right padded: [k, width-1], and the rows' prompt lengths."""
    rows = [PROMPTS[g] + r for g, r in zip(PROMPT_OF, RESPONSES, strict=True)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
    return token_logprobs(model, ids, attention, temperature), [len(PROMPTS[g]) for g in PROMPT_OF], width


def test_values_and_gradients_match_the_plain_pass(model_dir):
    model = load_model(model_dir).train()
    plain, prompt_lengths, width = _plain(model, 0.7)
    mask = torch.zeros_like(plain)
    for i, (p, r) in enumerate(zip(prompt_lengths, RESPONSES, strict=True)):
        mask[i, p - 1 : p - 1 + len(r)] = 1
    (plain * mask * torch.linspace(0.5, 2.0, plain.shape[1])).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    shared = grouped_logprobs(model, PROMPTS, RESPONSES, PROMPT_OF, 0.7)  # [k, R]
    assert shared.shape == (5, 6)
    placed = place(shared, prompt_lengths, width)
    (placed * torch.linspace(0.5, 2.0, plain.shape[1])).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    assert float((placed - plain * mask).detach().abs().max()) < 1e-5
    assert float(plain[mask.bool()].abs().min()) > 0, "real log-probs, not zeros"
    for i, r in enumerate(RESPONSES):
        assert torch.all(shared[i, len(r) :] == 0), "0 past a row's end"
    for name in want:
        rel = float((want[name] - got[name]).norm() / want[name].norm().clamp(min=1e-12))
        assert rel < 1e-5, (name, rel)


def test_bad_input_is_refused(model_dir):
    model = load_model(model_dir)
    with pytest.raises(ValueError, match="temperature"):
        grouped_logprobs(model, PROMPTS, RESPONSES, PROMPT_OF, 0.0)
    with pytest.raises(ValueError, match="prompt indices"):
        grouped_logprobs(model, PROMPTS, RESPONSES, PROMPT_OF[:2], 1.0)
    with pytest.raises(ValueError, match="at least one token"):
        grouped_logprobs(model, [[]], [[1]], [0], 1.0)
    assert grouped_logprobs(model, PROMPTS, [[], []], [0, 1], 1.0).shape == (2, 0)


@pytest.mark.parametrize("budget", [None, 12])
def test_trainer_gradient_is_the_plain_one(setup, budget):  # noqa: F811 - the imported fixture
    model_dir, groups = setup
    plain, m_plain = gradients(model_dir, groups, compute={"micro_batch_tokens": budget, "shared_prompt": False})
    shared, m_shared = gradients(model_dir, groups, compute={"micro_batch_tokens": budget, "shared_prompt": True})
    assert plain.keys() == shared.keys() and plain
    worst = max(float((plain[n] - shared[n]).abs().max()) for n in plain)
    assert worst < 1e-6, f"largest gradient difference {worst:.2e}"
    assert m_plain["loss"] == pytest.approx(m_shared["loss"], abs=1e-6)


def test_pack_groups_keeps_groups_together_within_the_budget():
    lengths = [5, 7, 6, 12, 11, 3, 3, 3]
    group_of = [0, 0, 0, 1, 1, 2, 2, 2]
    packed = pack_groups(lengths, group_of, budget=24)
    assert sorted(i for mb in packed for i in mb) == list(range(8))
    for mb in packed:
        assert len(mb) * max(lengths[i] for i in mb) <= 24 or len(mb) == 1, mb
    assert packed[0] == [3, 4], "the group with the longest row first, its rows longest first"
    assert [1, 2, 0] in packed and [5, 6, 7] in packed, "each group's rows together when they fit"
    assert pack_groups(lengths, group_of, None) == [[3, 4, 1, 2, 0, 5, 6, 7]]
    assert pack_groups([], [], 10) == []

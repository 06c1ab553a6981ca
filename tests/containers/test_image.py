"""The project image runs the same path as `relax run`: a `type: hf` task (datasets) scored by the `math` reward
(math-verify, in the reward sandbox), which need the `models` extra; and the Dockerfile's CUDA variant renders.

- The CPU image (the default VARIANT, as compose and the containers tier build it) runs `relax run` of a tiny
  model on the word-problem file for two steps, its reward role in the sandbox set up as the compose reward
  service; then, in the same container, the math reward scores a right answer 1 and a wrong one 0 (a tiny random
  model earns 0 anyway, so the run alone would not show math-verify working). ~1 min warm.
- The CUDA variant cannot be built here (no GPU, ~5 GB of CUDA wheels): its first stage, `requirements`, is
  built with VARIANT=cuda (seconds, nothing downloaded) and its lists are read back: CUDA torch from PyPI and
  vLLM's CUDA build. What its later stages install, and that the result runs on a GPU, is not checked here.

Needs root and Podman (`.ci/containers.sh` readies the host): skipped on a developer machine without them, failed
where containers are required (CI=true or RELAX_REQUIRE_CONTAINERS=1).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from tests.container_host import BUILD_TIMEOUT_S, prepare_host, project_image

pytestmark = pytest.mark.containers

ROOT = Path(__file__).resolve().parents[2]
REWARD = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["reward"]
RUN_TIMEOUT_S = 420  # two steps of the tiny model with every role starting (~1 min here)

CONFIG = """run: imagecheck
groups_per_step: 2
samples_per_group: 4
model:
  source: tiny:64x2
  seed: 0
task:
  type: hf
  options:
    path: /config/word_problems.jsonl
    template: "{question}"
    answer_regex: "####\\\\s*(.+)"
    seed: 0
rewards:
  - type: math
    options: {extract: last_number}
rollout:
  engine: torch
  max_new_tokens: 8
  batch_groups: 2
trainer:
  steps: 2
roles:
  rollout: 1
  reward: 1
"""

SCORE = """import json
from workers.rewards.scorer import Scorer
with Scorer([{"type": "math", "options": {"extract": "last_number"}}]) as scorer:
    right, wrong = scorer.score("So she has 5 left.", "5", "stop"), scorer.score("So she has 6 left.", "5", "stop")
print("SCORES " + json.dumps([right.reward, right.error, wrong.reward, wrong.error]))
"""


def sandbox_options() -> list[str]:
    """The compose reward service's security_opt, as `podman run` options (the sandbox's namespaces)."""
    options = []
    for opt in REWARD["security_opt"]:
        name, _, value = opt.replace(":", "=", 1).partition("=")
        options += ["--security-opt", f"{name}={ROOT / value if name == 'seccomp' else value}"]
    return options


@pytest.mark.timeout(BUILD_TIMEOUT_S + RUN_TIMEOUT_S + 120)
def test_the_image_runs_an_hf_task_scored_by_math_verify(tmp_path: Path) -> None:
    image = project_image()
    config = tmp_path / "config"
    config.mkdir()
    (config / "hfmath.yaml").write_text(CONFIG)
    (config / "score.py").write_text(SCORE)
    shutil.copy(ROOT / "examples" / "data" / "word_problems.jsonl", config)
    config.chmod(0o755)  # the image's user (uid 10001) reads them
    script = "relax run /config/hfmath.yaml --run-dir /var/lib/relax/runs/imagecheck && python /config/score.py"
    name = f"relaxtest-image-{uuid.uuid4().hex[:8]}"
    args = ["podman", "run", "--rm", "--name", name, "--network", "none", "-e", "HF_HUB_OFFLINE=1"]
    args += ["-v", f"{config}:/config:ro", *sandbox_options(), "--entrypoint", "sh", image, "-ec", script]
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True, timeout=60)
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"exit {result.returncode}:\n{out[-4000:]}"
    assert "run imagecheck: 2 steps in" in out, out[-4000:]
    (scores,) = [line for line in out.splitlines() if line.startswith("SCORES ")]
    assert json.loads(scores.removeprefix("SCORES ")) == [1.0, None, 0.0, None], scores


def _requirements(variant: str, tag: str) -> subprocess.CompletedProcess[str]:
    args = ["podman", "build", "--pull=never", "--target", "requirements", "--build-arg", f"VARIANT={variant}"]
    return subprocess.run([*args, "-t", tag, "."], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.timeout(900)
def test_the_cuda_variant_installs_cuda_torch_and_vllm() -> None:
    prepare_host()
    tag = f"relax-bus-requirements:{uuid.uuid4().hex[:8]}"
    try:
        built = _requirements("cuda", tag)
        assert built.returncode == 0, built.stderr[-3000:]
        read = ["podman", "run", "--rm", "--network", "none", "--entrypoint", "sh", tag, "-c"]
        listing = "cd /requirements && for f in variant torch.txt torch-index project.txt; do cat $f; done"
        files = subprocess.run([*read, listing], capture_output=True, text=True, timeout=120)
        assert files.returncode == 0, files.stderr
        lines = files.stdout.split()
        assert lines[:3] == ["cuda", "torch==2.13.*", "https://pypi.org/simple"], lines[:3]
        assert {"vllm==0.32.0", "math-verify==0.9.0", "transformers==5.19.0"} <= set(lines), lines
        refused = _requirements("gpu", tag)
        assert refused.returncode != 0 and "VARIANT='gpu': one of cpu, cuda" in refused.stdout + refused.stderr
    finally:
        subprocess.run(["podman", "rmi", "-f", tag], capture_output=True, timeout=120)

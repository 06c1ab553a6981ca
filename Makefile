# Relax-bus: `make test` runs everything CI runs; `make demo` arrives with the RL pipeline.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The stamp changes whenever pyproject.toml does, so a changed pin reinstalls.
STAMP  := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: install lint test test-unit test-bus bench demo clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[workers,test]"
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest $(PYTEST_ARGS)

test-unit: install
	$(VENV)/bin/pytest -m unit $(PYTEST_ARGS)

test-bus: install
	$(VENV)/bin/pytest -m "bus or cli" $(PYTEST_ARGS)

bench: install
	$(PY) benchmarks/bus_throughput.py

demo:
	@echo "make demo arrives with the RL pipeline (roles, trainer, tiny model); see README.md." >&2
	@exit 2

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

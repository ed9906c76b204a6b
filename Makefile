# The two commands README gives a newcomer: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STEPS ?= 600

.PHONY: demo test lint install bench docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'

demo: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[examples]'
	$(BIN)/python examples/digits.py --steps $(STEPS) --output-dir runs/digits

lint: install
	$(BIN)/ruff check flaxstate tests examples benchmarks docs
	$(BIN)/ruff format --check flaxstate tests examples benchmarks docs
	$(BIN)/mypy flaxstate

test: install lint
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/loop_overhead.py

# The docs site (Sphinx with myst-nb; the tutorials run at every build), warnings as errors.
docs: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[docs]'
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html
	$(BIN)/python -m pytest -q -p no:cacheprovider docs/tests

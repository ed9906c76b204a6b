# The two commands README gives a newcomer: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STEPS ?= 600

.PHONY: demo test test-fast test-processes test-under-load lint install bench docs docs-install docs-site quick-tier \
	process-tier

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

# The tests in their tiers (tests/README.md): `test-fast` those that run in one process (the edit-test loop),
# `test-processes` those that start processes or send signals; `make test` runs both.
# `quick-tier` and `process-tier` run a tier alone on a venv already installed (CI's lanes: see .ci/run).
test: test-fast test-processes

test-fast: install lint quick-tier

test-processes: install process-tier

# Tier 0 runs on WORKERS processes (pytest-xdist; 0: in pytest's own, as CI's lanes run it beside each other) and
# keeps its JAX compilation cache between runs, one a stack (tests/conftest.py's KEPT_CACHE): a run after an edit
# compiles only the programs the edit changed. `rm -rf .cache/jax-tests` empties it. Figures: tests/README.md.
WORKERS ?= 2
TEST_CACHE ?= $(CURDIR)/.cache/jax-tests/$(patsubst .%,%,$(notdir $(VENV)))
quick-tier:
	FLAXSTATE_TESTS_COMPILATION_CACHE="$(TEST_CACHE)" $(BIN)/python -m pytest -q -m "not processes" -n $(WORKERS)

process-tier:
	$(BIN)/python -m pytest -q -m processes

# Tiers 1 and 2 beside a CPU burner on every core for the whole session, started before the first test and stopped
# by its pid after the last (`--under-load`, tests/conftest.py): users' machines are loaded. RUNS=3 runs it three
# times in a row, stopping at the first that fails; TIERS="processes and not joined" runs tier 2 alone, "joined"
# tier 1 alone; PYTEST_ARGS adds to pytest's arguments (a run's number is in $$RUN).
RUNS ?= 1
TIERS ?= processes
PYTEST_ARGS ?=
test-under-load: install
	@for run in $$(seq $(RUNS)); do \
		echo "== make test-under-load: run $$run of $(RUNS), -m '$(TIERS)' =="; \
		export RUN=$$run; $(BIN)/python -m pytest -q -m "$(TIERS)" --under-load $(PYTEST_ARGS) || exit 1; \
	done

bench: install
	$(BIN)/python benchmarks/loop_overhead.py

# The docs site (Sphinx with myst-nb; the tutorials run at every build), warnings as errors, then its checks. The
# browser checks need Chromium (CHROMIUM, by default Debian's `chromium` on PATH): without one they are not run and
# `make docs` says so; DOCS_BROWSER=required (CI's) makes a missing browser an error.
CHROMIUM ?= $(shell command -v chromium 2>/dev/null)
DOCS_BROWSER ?= optional
docs: docs-install docs-site

docs-install: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[docs]'

# The site and its checks alone, on a venv that has the docs' extra (CI builds it beside the tests: see .ci/run).
docs-site:
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html
	@if [ -n "$(CHROMIUM)" ]; then \
		CHROMIUM="$(CHROMIUM)" $(BIN)/python -m pytest -q -p no:cacheprovider docs/tests; \
	elif [ "$(DOCS_BROWSER)" = required ]; then \
		echo "make docs: no Chromium for the browser checks (DOCS_BROWSER=required): apt-get install chromium," \
			"or set CHROMIUM to its path" >&2; \
		exit 1; \
	else \
		$(BIN)/python -m pytest -q -p no:cacheprovider -m "not browser" docs/tests && \
		echo "make docs: the site is built and checked; the browser checks were not run: no Chromium" \
			"(apt-get install chromium, or set CHROMIUM to its path, to run them)"; \
	fi

# Entry points that set themselves up: each target creates/refreshes .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# pytest-xdist: one worker per core; a module's tests stay on one worker (tests/conftest.py).
PYTEST_PARALLEL ?= -n auto --dist loadscope

.PHONY: setup demo test test-long test-fast lint

setup:
	@VENV=$(VENV) scripts/bootstrap.sh

demo: setup
	$(VENV)/bin/megatron-lns demo $(DEMO_ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -m "not long" $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# The tests of a quarter of a minute or more and the SLURM jobs (CI runs them after `test`).
test-long: setup
	$(PY) -m pytest -m long $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_PARALLEL) $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Entry points that set themselves up: each target creates/refreshes .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast lint

setup:
	@VENV=$(VENV) scripts/bootstrap.sh

demo: setup
	$(VENV)/bin/megatron-lns demo $(DEMO_ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Set-up installs torch==2.13.0 (the local CPU build) first: any other torch requirement
# pulls gigabytes of CUDA wheels.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000

.PHONY: setup serve test test-fast lint-imports clean

$(BIN)/qswap: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/qswap

serve: setup
	$(BIN)/qswap serve --port $(PORT)

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint-imports: setup
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache

# Set-up installs torch==2.13.0 (the local CPU build) first: any other torch requirement
# pulls gigabytes of CUDA wheels.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000

.PHONY: setup serve test test-fast docs debian-lists clean

# Bytecode is written as modules are first imported, not ahead: pip would compile each of the
# venv's ~25,000 files one at a time (~80 s of the set-up on 2 cores), and compiling them all ahead
# (compileall on every core) still costs ~40 s, while the servers, CLI runs and Ray workers of a
# test run import about a quarter of them. Where the environment sets PYTHONDONTWRITEBYTECODE, every
# such process (hundreds in a test run) would compile what it imports again: the recipes run
# without it, so the first process to import a module writes its bytecode and the rest load it.
unexport PYTHONDONTWRITEBYTECODE

$(BIN)/qswap: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -e '.[dev,ray,milvus,langchain,llamaindex,docs]'
	touch $@

setup: $(BIN)/qswap

serve: setup
	$(BIN)/qswap serve --port $(PORT)

# Debian package descriptions (English + de/fr/it translations) for the slow real-data tests
# and benchmarks. A plain `apt-get update` later drops the translations again.
debian-lists:
	@if ls /var/lib/apt/lists/*i18n_Translation-de* >/dev/null 2>&1 && command -v lz4cat >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  apt-get -q -o Acquire::Languages="en,de,fr,it" update >/dev/null && apt-get install -y -q lz4 >/dev/null; \
	else echo "run as root: apt-get -o Acquire::Languages=en,de,fr,it update && apt-get install -y lz4"; exit 1; fi

# Two pytest-xdist workers: many tests wait on servers and subprocesses, so two overlap on 2 cores.
# A group of tests (a module, or all Ray and Milvus-server tests: tests/workers.py) runs on one
# worker. Tests marked `serial` assert a wall-clock bound and run afterwards, alone. Both parts
# always run; the target fails if either did.
JOBS ?= 2
test: setup debian-lists
	@rc=0; \
	$(BIN)/python -m pytest -q -n $(JOBS) -m "not serial" --durations=25 || rc=$$?; \
	$(BIN)/python -m pytest -q -m serial --durations=5 || rc=$$?; \
	exit $$rc

# The documentation site (docs/, mkdocs.yml) into site/; strict: broken links and references fail.
docs: setup
	$(BIN)/mkdocs build --strict

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache site build/docs-src

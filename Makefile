# Set-up installs torch==2.13.0 (the local CPU build) first: any other torch requirement
# pulls gigabytes of CUDA wheels.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000

.PHONY: setup serve test test-fast docs debian-lists clean

# pip compiles each installed file to bytecode one at a time (~80 s of the set-up on 2 cores):
# compileall does it on every core afterwards. Compiled it must be: where PYTHONDONTWRITEBYTECODE
# is set, every process (servers, Ray workers) would compile what it imports again. A file that does
# not compile is skipped, as pip skips it: some packages ship files for newer Pythons (torch's
# py312 test helpers).
$(BIN)/qswap: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -e '.[dev,ray,milvus,langchain,llamaindex,docs]'
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
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
# The project's own sources are compiled first, on every core: where PYTHONDONTWRITEBYTECODE is
# set, each process the tests start (servers, CLI runs, Ray workers: hundreds) would otherwise
# compile the qswap modules it imports again (~0.3 s of CPU each on this 2-core machine).
SRC_DIRS := core cli server index encoders tuning bench client
test: setup debian-lists
	@$(BIN)/python -m compileall -qq -j 0 $(SRC_DIRS) || true
	@rc=0; \
	$(BIN)/python -m pytest -q -n $(JOBS) -m "not serial" --durations=25 || rc=$$?; \
	$(BIN)/python -m pytest -q -m serial --durations=5 || rc=$$?; \
	exit $$rc

# The documentation site (docs/, mkdocs.yml) into site/; strict: broken links and references fail.
docs: setup
	$(BIN)/mkdocs build --strict

test-fast: setup
	@$(BIN)/python -m compileall -qq -j 0 $(SRC_DIRS) || true
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache site build/docs-src

"""Shared fixtures: tiny random-weight models built from a config (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qswap.bench.tiny_model import make_tiny_model

from .workers import check_services_modules, last_users, make_scheduler, order_for_workers

# Per-test bound (pytest-timeout) of tests with real weights or a Ray cluster: their fixtures
# (a cluster start with one retry, a model export) run inside the first test that uses them.
SLOW_TIMEOUT_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give slow-marked and Ray tests the longer bound, unless a test sets its own; on an xdist
    worker, order the tests by group (tests/workers.py)."""
    for item in items:
        if item.get_closest_marker("timeout") is None and (
                item.get_closest_marker("slow") is not None or "tests/ray/" in item.nodeid):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    check_services_modules(items)
    if hasattr(config, "workerinput"):   # every worker sorts alike: the scheduler checks they agree
        order_for_workers(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """Once the last Milvus-server test and its module's fixtures are done, stop the server: it
    would take ~0.1 CPU while idle beside the worker's other tests until the session ends."""
    try:
        return (yield)
    finally:
        if _MILVUS_RUNNING and item.nodeid == last_users(item.session.items).get("milvus"):
            while _MILVUS_RUNNING:
                _MILVUS_RUNNING.pop().kill()


@pytest.hookimpl(optionalhook=True)   # a hook of pytest-xdist, a dev dependency
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under ``pytest -n N``, schedule whole groups (tests/workers.py), whatever ``--dist`` says."""
    return make_scheduler(config, log)


__all__ = ["make_tiny_model"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT model directory, shared by the whole session (treat as read-only)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def other_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny model with other weights: a different embedding space."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny2") / "model", seed=1)


@pytest.fixture(scope="session")
def tiny_base(tiny_model_dir: Path):
    from qswap.encoders.base import load_base
    return load_base(tiny_model_dir, device="cpu")


_MILVUS_FACTS: dict = {}
_MILVUS_RUNNING: list = []   # the session's Milvus server while it runs (pytest_runtest_teardown stops it)


@pytest.fixture(scope="session")
def milvus_server(tmp_path_factory: pytest.TempPathFactory):
    """A real Milvus server process (the `milvus` package's standalone build) for the whole session:
    started on first use, stopped at the end; its version is printed in the run's summary."""
    from qswap.bench.milvus_server import LocalMilvus, milvus_package_version
    if milvus_package_version() is None:
        pytest.skip("no Milvus server build installed (pip install 'qswap[milvus]')")
    srv = LocalMilvus(tmp_path_factory.mktemp("milvus-server"), short_intervals=True)
    _MILVUS_RUNNING.append(srv)
    try:
        srv.start()
        _MILVUS_FACTS.update(srv.facts())
        yield srv
    finally:
        srv.kill()   # its data is the session's to discard: no 20 s graceful stop (SIGTERM is not enough)
        if srv in _MILVUS_RUNNING:
            _MILVUS_RUNNING.remove(srv)


def pytest_terminal_summary(terminalreporter) -> None:
    if _MILVUS_FACTS:
        f = _MILVUS_FACTS
        terminalreporter.write_line(f"Milvus server under test: {f['server_version']} ({f['package']}, "
                                    f"started in {f['start_seconds']} s)")

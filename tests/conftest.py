"""Shared fixtures: tiny random-weight models built from a config (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qswap.bench.tiny_model import make_tiny_model

# Per-test bound (pytest-timeout) of tests with real weights or a Ray cluster: their fixtures
# (a cluster start with one retry, a model export) run inside the first test that uses them.
SLOW_TIMEOUT_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give slow-marked and Ray tests the longer bound, unless a test sets its own."""
    for item in items:
        if item.get_closest_marker("timeout") is None and (
                item.get_closest_marker("slow") is not None or "tests/ray/" in item.nodeid):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


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

"""Benchmark data: the Debian descriptions benchmark (BEIR layout), synthetic vectors.

- :func:`qswap.bench.data.debian.build_debian_beir` / :func:`~qswap.bench.data.debian.write_demo_corpus`
- :func:`qswap.bench.data.synthetic.clustered_embeddings` / :func:`~qswap.bench.data.synthetic.exact_ground_truth`
- :func:`qswap.bench.data.cli.register`: the ``qswap bench data`` command group

BEIR directories (the Debian benchmark's and any other) are read with :mod:`qswap.beir`.
Submodules are imported on use, so ``import qswap.bench.data`` stays cheap (no numpy/faiss).
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_debian_beir", "write_demo_corpus", "clustered_embeddings", "exact_ground_truth", "register"]

_HOME = {
    "build_debian_beir": "debian",
    "write_demo_corpus": "debian",
    "clustered_embeddings": "synthetic",
    "exact_ground_truth": "synthetic",
    "register": "cli",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(f"qswap.bench.data.{_HOME[name]}"), name)
    raise AttributeError(name)

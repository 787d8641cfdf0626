"""Matplotlib set-up for every PNG qswap writes (benchmarks, tuning reports): one place for the backend."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend: files only, no display needed (servers, CI)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt

"""Matplotlib set-up for every PNG qswap writes (benchmarks, tuning reports): one place for the backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend: files only, no display needed (servers, CI)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig: Any, path: Path, dpi: int = 120) -> Path:
    """Lay out ``fig``, write it as a PNG at ``path`` (parent folders made) and free it."""
    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    # pyplot keeps every figure alive until closed: long runs that plot often would grow.
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path

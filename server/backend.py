"""What runs the query forward passes: the torch :class:`EncoderPool`, or ONNX Runtime.

The batch worker only calls ``backend.encode(texts, keys)``. The registry tells the backend
when an encoder appears (``prepare``) and disappears (``discard``); the torch backend needs
neither, the ONNX one exports in the background and falls back to the pool until ready.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from qswap.encoders import EncoderPool
from qswap.errors import InvalidInputError


class Backend(Protocol):
    def encode(self, texts: list[str], keys: list[str]) -> np.ndarray: ...
    def prepare(self, key: str) -> None: ...
    def discard(self, key: str) -> None: ...
    def ready(self, key: str) -> bool: ...
    def error(self, key: str) -> str | None: ...
    def memory_bytes(self, key: str) -> int: ...


def runtime_of(backend: Backend, key: str) -> dict[str, str | None]:
    """What runs ``key``'s forward passes now: ``onnx`` once its export is ready, else ``torch``
    (and why the export failed, if it did). Operators read it in ``GET /v1/encoders``."""
    if isinstance(backend, TorchBackend):
        return {"runtime": "torch", "runtime_error": None}
    return {"runtime": "onnx" if backend.ready(key) else "torch", "runtime_error": backend.error(key)}


class TorchBackend:
    """Forward passes in the shared-base pool (mixed LoRA rows in one pass)."""

    name = "torch"

    def __init__(self, pool: EncoderPool) -> None:
        self.pool = pool

    def encode(self, texts: list[str], keys: list[str]) -> np.ndarray:
        return self.pool.encode(texts, keys)

    def prepare(self, key: str) -> None:
        """Nothing to prepare: the pool already holds the encoder."""

    def discard(self, key: str) -> None:
        """Nothing to free beyond what the pool frees."""

    def ready(self, key: str) -> bool:
        """The pool serves every loaded encoder directly."""
        return key in self.pool

    def error(self, key: str) -> str | None:
        return None

    def memory_bytes(self, key: str) -> int:
        """Nothing beyond the pool's own bytes for the encoder."""
        return 0


def make_backend(kind: str, pool: EncoderPool, cache_dir: Path, threads: int | None = None) -> Backend:
    """The configured backend; ONNX Runtime is imported only when asked for."""
    if kind == "torch":
        return TorchBackend(pool)
    if kind == "onnx":
        try:
            from qswap.encoders.onnx import OnnxBackend
        except ImportError as e:
            raise InvalidInputError(f"the onnx backend is not available: {e}",
                                    "install onnxruntime and onnx, or use --backend torch") from None
        return OnnxBackend(pool, cache_dir, threads=threads)
    raise InvalidInputError(f"unknown backend {kind!r}", "use 'torch' or 'onnx'")

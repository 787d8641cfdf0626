"""Choosing what runs the query forward passes: one shared ONNX Runtime session (default), merged
per-encoder ONNX exports, or the torch :class:`EncoderPool` (the reference and fallback, here).

The batch worker only calls ``backend.encode(texts, keys)``. The registry tells the backend
when an encoder appears (``prepare``) and disappears (``discard``); the torch backend needs
neither, the ONNX ones export in the background and fall back to the pool until ready.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from qswap.encoders.pool import EncoderPool
from qswap.encoders.runtime.hot import DEFAULT_HOT
from qswap.encoders.precision import BF16_MIN_QUERY_BATCH, autocast_context, check_precision
from qswap.encoders.runtime.protocol import Backend, EncodeFlagged
from qswap.errors import InvalidInputError


# --backend choices; the first is the default. ``cuda``: the gathered-adapter forward in CUDA
# graphs (qswap.encoders.runtime.cuda; on a machine without a GPU its buckets run eagerly).
BACKENDS = ("shared", "onnx", "torch", "cuda")


def runtime_of(backend: Backend, key: str) -> dict[str, str | None]:
    """What runs ``key``'s forward passes now: ``onnx-shared`` (the shared session),
    ``onnx`` (its own merged export) once ready, else ``torch`` (and why an export failed, if
    one did). Operators read it in ``GET /v1/encoders``."""
    name = backend.runtime(key)
    return {"runtime": "onnx" if name == "onnx-merged" else name, "runtime_error": backend.error(key)}


class TorchBackend:
    """Forward passes in the shared-base pool (mixed LoRA rows in one pass).

    ``precision="bf16"`` runs batches of at least ``bf16_min_batch`` queries for one encoder
    under bf16 autocast; smaller batches and batches mixing encoders stay fp32, where bf16 was
    measured slower (``qswap bench serving --query-precision``: 8 mixed LoRA encoders at
    concurrency 32 lost a quarter of their throughput). The rows' vectors then differ from fp32
    by a cosine of ~1e-5 (``qswap bench bf16-quality``).
    """

    name = "torch"
    encode_flagged: EncodeFlagged | None = None   # the server's tokenizer flags truncation

    def __init__(self, pool: EncoderPool, precision: str = "fp32",
                 bf16_min_batch: int = BF16_MIN_QUERY_BATCH) -> None:
        self.pool = pool
        self.precision = check_precision(precision)
        self.bf16_min_batch = bf16_min_batch
        autocast_context(pool.base.device, precision)   # refuses a device without autocast, warns if emulated, now

    def precision_for(self, rows: int, encoders: int = 1) -> str:
        """The precision a batch of ``rows`` queries over ``encoders`` distinct encoders runs at."""
        bf16 = self.precision == "bf16" and rows >= self.bf16_min_batch and encoders == 1
        return "bf16" if bf16 else "fp32"

    def encode(self, texts: list[str], keys: list[str], encodings: list[Any] | None = None) -> np.ndarray:
        # Autocast is thread-local: entered here, on the batch worker's thread, around the pass.
        precision = self.precision_for(len(texts), len(set(keys)))
        with autocast_context(self.pool.base.device, precision):
            return self.pool.encode(texts, keys, encodings=encodings)

    def count_rows(self, keys: list[str]) -> None:
        """Every encoder runs in the same pool: nothing to adapt."""

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

    def building(self) -> list[str]:
        """Nothing is built in the background: the pool serves at once."""
        return []

    def builds_started(self) -> dict[str, int]:
        """None: nothing is built in the background."""
        return {}

    def runtime(self, key: str) -> str:
        """Always the torch pool."""
        return "torch"

    def close(self) -> None:
        """Nothing to release beyond the pool."""


def make_backend(kind: str, pool: EncoderPool, cache_dir: Path, threads: int | None = None,
                 precision: str = "fp32", retry_s: float | None = None, spin: bool = True,
                 hot: int = DEFAULT_HOT, mix: str | None = None) -> Backend:
    """The configured backend (:data:`BACKENDS`); ONNX Runtime is imported only when asked for.

    ``precision`` is the torch and cuda backends' query precision (cuda also takes ``fp16``); the
    ONNX graphs are fp32 only.
    ``retry_s``: the shared backend tries a failed export again after this many seconds
    (doubling); None: never. ``spin``: ONNX Runtime's intra-op workers busy-wait inside a
    forward (:func:`qswap.encoders.runtime.onnx.make_session`). ``hot``: the shared backend's
    merged sessions for the encoders with most of the traffic (:mod:`qswap.encoders.runtime.hot`).
    ``mix``: how the shared backend runs a batch that mixes encoders
    (:data:`qswap.encoders.runtime.shared.MIXES`; None: its default).
    """
    if kind == "torch":
        return TorchBackend(pool, precision)
    if kind == "cuda":
        from qswap.encoders.runtime.cuda import CudaBackend
        return CudaBackend(pool, precision)
    if precision != "fp32":
        raise InvalidInputError(f"query precision {precision} is only available on the torch backend",
                                "drop --query-precision, or use --backend torch")
    if kind in ("shared", "onnx"):
        try:
            from qswap.encoders.runtime.onnx import OnnxBackend
            from qswap.encoders.runtime.shared import DEFAULT_MIX, SharedBackend
        except ImportError as e:
            raise InvalidInputError(f"the {kind} backend is not available: {e}",
                                    "install onnxruntime and onnx, or use --backend torch") from None
        if kind == "shared":
            return SharedBackend(pool, cache_dir, threads=threads, retry_s=retry_s, spin=spin, hot=hot,
                                 mix=DEFAULT_MIX if mix is None else mix)
        return OnnxBackend(pool, cache_dir, threads=threads, spin=spin)
    raise InvalidInputError(f"unknown backend {kind!r}", f"use one of {', '.join(BACKENDS)}")

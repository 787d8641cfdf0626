"""A frozen text tower as two functions, documents and queries: what indexing embeds with.

``qswap index build``/``add``/``search``, each Ray Data embedder actor and the embedding
benchmarks load one here. On the ONNX runtime (fp32 on a CPU, the default) documents and queries
both run the base's ONNX graph, and the base is loaded from the layout and export cached in the
data directory: once those are there (after the first command that embeds with the model), a
process neither imports torch nor builds the torch model. The torch runtime, and a first run
that exports the graph, load the torch model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qswap.space import EmbeddingSpace


@dataclass
class Embedder:
    """A base model as two functions: documents (with the document prefix) and queries.

    ``record``: how documents are embedded (precision, runtime, measured quality), as the
    index manifest records it."""

    name: str
    space: EmbeddingSpace
    documents: Callable[[list[str]], np.ndarray]
    queries: Callable[[list[str]], np.ndarray]
    record: dict[str, Any] = field(default_factory=lambda: {"precision": "fp32"})


def load_embedder(model: str, precision: str = "fp32", runtime: str | None = None,
                  threads: int | None = None) -> Embedder:
    """The frozen text tower of ``model`` (bundled name or local model folder).

    Documents go through :class:`~qswap.encoders.runtime.documents.DocumentEncoder` (fp32: the fused
    ONNX Runtime graph; bf16: torch autocast; ``runtime="torch"``: the torch reference). Queries
    run on the same runtime: the base's ONNX graph, or the torch model
    (:meth:`~qswap.encoders.base.BaseEncoder.encode_queries`) on the others.

    Args:
        model: a bundled model name or a local model folder.
        precision: ``fp32`` or ``bf16`` for documents.
        runtime: ``onnx`` or ``torch`` (default: by precision).
        threads: compute threads (default: all cores).

    Returns:
        The model's document and query functions, and how documents are embedded.
    """
    from qswap.encoders.base import load_base
    from qswap.encoders.runtime.documents import DocumentEncoder, check_document_precision
    from qswap.paths import data_dir

    check_document_precision(precision)
    if runtime == "onnx" or (runtime is None and precision == "fp32" and not _gpu_possible()):
        # ONNX Runtime on the CPU: the base's layout is recorded beside the exports (the
        # DocumentEncoder's cache), so that later loads need neither torch nor the torch model.
        base = load_base(model, device="cpu", cache_dir=data_dir() / "onnx")
    else:
        base = load_base(model)
    docs = DocumentEncoder(base, precision=precision, runtime=runtime, threads=threads)
    return Embedder(name=model, space=base.space, documents=docs, queries=docs.encode_queries, record=docs.record)


def _gpu_possible() -> bool:
    """Whether a GPU driver is visible (NVIDIA, or AMD's ROCm), read from the system rather than
    by importing torch: where none is, torch would place the base on the CPU anyway."""
    nvidia = Path("/proc/driver/nvidia/gpus")
    return (nvidia.is_dir() and any(nvidia.iterdir())) or Path("/dev/kfd").exists()


def document_embedder(model: str, precision: str = "fp32", runtime: str | None = None,
                      threads: int | None = None) -> Callable[[list[str]], Any]:
    """``embed(texts)`` of ``model``'s document tower (what each Ray embedder actor builds).

    Args:
        model: a bundled model name or a local model folder.
        precision: ``fp32`` or ``bf16``.
        runtime: ``onnx`` or ``torch`` (default: by precision).
        threads: compute threads.

    Returns:
        The document embedding function.
    """
    return load_embedder(model, precision=precision, runtime=runtime, threads=threads).documents

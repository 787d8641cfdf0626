"""A frozen text tower as two functions, documents and queries: what indexing embeds with.

``qswap index build``/``add``/``search``, each Ray Data embedder actor and the embedding
benchmarks load one here. torch is imported only when a model is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
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
    ONNX Runtime graph; bf16: torch autocast; ``runtime="torch"``: the torch reference).

    Args:
        model: a bundled model name or a local model folder.
        precision: ``fp32`` or ``bf16`` for documents.
        runtime: ``onnx`` or ``torch`` (default: by precision).
        threads: compute threads (default: all cores).

    Returns:
        The model's document and query functions, and how documents are embedded.
    """
    from qswap.encoders import load_base  # torch is imported only by commands that embed
    from qswap.encoders.runtime.documents import DocumentEncoder, check_document_precision

    check_document_precision(precision)
    base = load_base(model)
    docs = DocumentEncoder(base, precision=precision, runtime=runtime, threads=threads)
    return Embedder(name=model, space=base.space, documents=docs,
                    queries=lambda texts: base.encode_queries(texts), record=docs.record)


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

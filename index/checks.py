"""Input checks every index backend applies the same way: filters, ids, vectors."""

from __future__ import annotations

from typing import Any

import numpy as np

from qswap.errors import InvalidInputError
from qswap.index.corpus import Document, check_documents, require_utf8

# Metadata fields one filter may compare (each is a SQL condition; SQLite caps expression depth).
MAX_FILTER_FIELDS = 64
# Metadata integers are signed 64-bit (SQLite's and Milvus's JSON integers).
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1


def json_path(field: str) -> str:
    """The SQLite JSON path of a top-level metadata field (a name without quotes or backslashes)."""
    if not isinstance(field, str) or not field or '"' in field or "\\" in field:
        raise InvalidInputError(f"bad filter field {field!r}",
                                "filter on a top-level metadata field name without quotes or backslashes")
    require_utf8(field, "filter field")
    return f'$."{field}"'


def check_filter(flt: Any) -> None:
    """Refuse filters no backend can evaluate: not an object, too many fields, values out of range."""
    if not isinstance(flt, dict):
        raise InvalidInputError("filter must be an object of field: value", 'e.g. {"section": "games"}')
    if len(flt) > MAX_FILTER_FIELDS:
        raise InvalidInputError(f"filter compares {len(flt)} fields; at most {MAX_FILTER_FIELDS} are allowed",
                                "filter on fewer metadata fields")
    for field, value in flt.items():
        json_path(field)
        if isinstance(value, str):
            require_utf8(value, f"filter {field!r} value")
        elif isinstance(value, int) and not isinstance(value, bool) and not _INT_MIN <= value <= _INT_MAX:
            raise InvalidInputError(f"filter {field}: {value} is outside the signed 64-bit integer range",
                                    "filter on integers between -2**63 and 2**63-1")
        elif isinstance(value, float) and not np.isfinite(value):
            raise InvalidInputError(f"filter {field}: {value} is not a finite number", "use a finite number")
        elif value is not None and not isinstance(value, (str, int, float, bool)):
            raise InvalidInputError(f"filter {field}: unsupported value type {type(value).__name__}",
                                    "filters compare a field with one string, number, boolean or null")


def check_ids(ids: list[Any]) -> None:
    """External ids given to look up or delete: strings UTF-8 can encode."""
    for i in ids:
        if not isinstance(i, str):
            raise InvalidInputError(f"ids must be strings, got {type(i).__name__}", "pass external ids as str")
        require_utf8(i, "document id")


def row_norms(a: np.ndarray) -> np.ndarray:
    """The L2 norm of each row of a 2-d float array, as an ``(n, 1)`` column (to divide by).

    ``np.linalg.norm(a, axis=1, keepdims=True)`` computes exactly this, with more argument
    handling per call: every search normalises its queries and renormalises the rows it rescores.
    """
    return np.sqrt(np.add.reduce(a * a, axis=1, keepdims=True))


def normalize_rows(x: Any, full_dim: int, what: str = "embeddings") -> np.ndarray:
    """Check an (n, full_dim) matrix of finite non-zero rows; return it L2-normalised, float32."""
    try:
        a = np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"{what} are not a numeric array ({e})", "pass a float32 numpy array") from None
    if a.ndim != 2 or a.shape[1] != full_dim:
        raise InvalidInputError(f"{what} have shape {a.shape}, expected (n, {full_dim})",
                                f"embed with the index's base model (dimension {full_dim})")
    # A NaN or infinity makes its row's norm non-finite, so the whole matrix is checked only then
    # (a finite row can overflow float32 too: it passes).
    norms = row_norms(a)
    if not np.isfinite(norms).all() and not np.isfinite(a).all():
        bad = int(np.flatnonzero(~np.isfinite(a).all(axis=1))[0])
        raise InvalidInputError(f"{what}: row {bad} has NaN or infinite values",
                                "check the embedding model's output")
    if (norms == 0).any():
        bad = int(np.flatnonzero(norms[:, 0] == 0)[0])
        raise InvalidInputError(f"{what}: row {bad} is all zeros", "a zero vector has no direction to compare")
    return a / norms


def check_k(k: Any) -> int:
    """The number of hits asked for: a positive integer."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise InvalidInputError(f"k must be a positive integer, got {k!r}", "ask for at least one result")
    return int(k)


def as_queries(queries: Any, full_dim: int) -> np.ndarray:
    """A query vector or matrix as checked, L2-normalised ``(n, full_dim)`` float32 rows."""
    q = np.asarray(queries, dtype=np.float32)
    if q.ndim == 1:
        q = q[None, :]
    if q.ndim != 2 or q.shape[1] != full_dim:
        raise InvalidInputError(f"queries have shape {q.shape}, expected (n, {full_dim})",
                                "encode queries with an encoder of the index's embedding space")
    if len(q) == 0:
        return q
    return normalize_rows(q, full_dim, "queries")


def documents_and_rows(docs: Any, embeddings: Any, full_dim: int) -> tuple[list[Document], np.ndarray | None]:
    """Documents to write and their embeddings, checked: one finite non-zero row per document,
    L2-normalised. No documents: ``(docs, None)``, whatever ``embeddings`` holds."""
    docs = list(docs)
    check_documents(docs)
    if not docs:
        return docs, None
    x = normalize_rows(embeddings, full_dim)
    if len(x) != len(docs):
        raise InvalidInputError(f"{len(docs)} documents but {len(x)} embeddings", "pass one embedding per document")
    return docs, x


def documents_with_embeddings(docs: Any, embeddings: Any, full_dim: int) -> tuple[list[Document], np.ndarray]:
    """Documents for a new index and their embeddings, checked (:func:`documents_and_rows`): at
    least one document."""
    docs, x = documents_and_rows(docs, embeddings, full_dim)
    if x is None:
        raise InvalidInputError("no documents to index", "pass at least one document")
    return docs, x

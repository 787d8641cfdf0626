"""What a query backend is to its users (the server's batch worker and registry): the
:class:`Backend` protocol every runtime implements. Its own file so that the runtimes and the
factory that chooses between them (:mod:`qswap.encoders.runtime.backend`) import it, and not
each other.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np


#: ``(texts, keys) -> (vectors, truncated flags)`` from one tokenisation.
EncodeFlagged = Callable[[list[str], list[str]], tuple[np.ndarray, list[bool]]]


class Backend(Protocol):
    """What the server's batch worker and registry use of a query backend (every backend has
    every member, so callers never probe for one)."""

    #: ``encode`` that also says which texts the tokenizer cut, from the same tokenisation; ``None``
    #: where the backend does not tokenise itself (the caller asks the tokenizer).
    encode_flagged: EncodeFlagged | None

    def encode(self, texts: list[str], keys: list[str], encodings: list[Any] | None = None) -> np.ndarray:
        """Row ``i`` embedded as a query by encoder ``keys[i]``: (n, dim) float32, input order.
        ``encodings``: the texts' tokenizer encodings (query prefix included) when the caller
        has them (the server's tokens stage): then the backend does not tokenise again."""
    def count_rows(self, keys: list[str]) -> None:
        """The encoders of rows a server served to its users (one key per row; not guard or tuning
        passes): the shared backend runs an encoder with most of them on a merged graph
        (:mod:`qswap.encoders.runtime.hot`); the others ignore it."""
    def prepare(self, key: str) -> None: ...
    def discard(self, key: str) -> None: ...
    def ready(self, key: str) -> bool: ...
    def error(self, key: str) -> str | None: ...
    def memory_bytes(self, key: str) -> int: ...
    def building(self) -> list[str]:
        """What is still built in the background (graphs, sessions), by kind; answers run on a
        slower path meanwhile (``GET /readyz`` says it as ``warming``)."""
    def builds_started(self) -> dict[str, int]:
        """Background builds started since the backend was made, by the kinds :meth:`building` names,
        never decreasing: two reads that differ mean something was built between them, even a build
        that had finished by the second (the server exports them as ``qswap_runtime_builds_total``)."""
    def runtime(self, key: str) -> str:
        """What runs ``key`` now: ``torch``, ``onnx-merged`` (its own export), ``onnx-shared``, or on the
        cuda backend ``cuda-graph`` / ``gathered`` (the same buckets run eagerly)."""
    def close(self) -> None: ...


def _counted(backend: Backend, run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` for a server's batches: each batch's rows are counted first
    (:meth:`Backend.count_rows`), so what a server serves decides which encoders are hot."""
    def encode(texts: list[str], keys: list[str], encodings: list[Any] | None = None) -> Any:
        backend.count_rows(keys)
        return run(texts, keys, encodings=encodings)
    return encode


def served(backend: Backend) -> Callable[..., np.ndarray]:
    """``backend.encode`` for a server's batches, rows counted (:func:`_counted`)."""
    return _counted(backend, backend.encode)


def served_single(backend: Backend) -> Callable[..., tuple[np.ndarray, list[bool]]] | None:
    """A server's batches on one core (``backend.encode_flagged_single``, else
    ``encode_flagged_bulk``: its single-threaded sessions), rows counted as :func:`served` counts
    them; None for a backend without one (then a server runs one forward lane)."""
    single = getattr(backend, "encode_flagged_single", None) or getattr(backend, "encode_flagged_bulk", None)
    return None if single is None else _counted(backend, single)

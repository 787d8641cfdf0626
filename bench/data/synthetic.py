"""Synthetic clustered embeddings and their exact nearest neighbours, for index scale tests.

Points are unit vectors around ``n_clusters`` random unit centres: ``x = c + noise * g``
with ``g ~ N(0, I/dim)`` (so ``|noise * g| ~ noise``), then normalised. The cosine of a
point to its centre is about ``1/sqrt(1 + noise^2)`` and between two points of one cluster
about ``1/(1 + noise^2)`` (0.74 at the default 0.6); centres are nearly orthogonal to
each other in high dimension. Cluster sizes are uneven (log-normal weights), like the
topics of a real corpus, which is what makes IVF lists uneven.

Everything is a function of ``seed``: centres and weights from one stream, the points of
each 65,536-row block from their own streams, so the result does not depend on memory
or on how it is written, the first ``m`` of ``n`` points are the ``m``-point set, and queries (``stream="queries"``) are fresh points from the same
distribution, never copies of base points.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np

from qswap.errors import InvalidInputError

BLOCK = 65_536  # rows generated per random stream; fixed so output is chunking-independent
_STREAMS = {"base": 1, "queries": 2}


def cluster_model(dim: int, n_clusters: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The centres ``(n_clusters, dim)`` (unit, float32) and cluster probabilities of ``seed``."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0]))
    centres = rng.standard_normal((n_clusters, dim), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    weights = rng.lognormal(0.0, 1.0, n_clusters)
    return centres, weights / weights.sum()


def _block(
    block: int, rows: int, centres: np.ndarray, probs: np.ndarray, noise: float, seed: int, stream: int
) -> np.ndarray:
    # Labels and noise from separate streams, each filled row by row: the first r rows of a
    # block are the same whatever its length, so a smaller set is a prefix of a larger one.
    labels_rng = np.random.default_rng(np.random.SeedSequence([seed, stream, block, 0]))
    noise_rng = np.random.default_rng(np.random.SeedSequence([seed, stream, block, 1]))
    labels = labels_rng.choice(len(centres), size=rows, p=probs)
    x = noise_rng.standard_normal((rows, centres.shape[1]), dtype=np.float32)
    x *= np.float32(noise / np.sqrt(centres.shape[1]))
    x += centres[labels]
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def clustered_embeddings(
    n: int,
    dim: int = 384,
    n_clusters: int = 1024,
    seed: int = 0,
    noise: float = 0.6,
    *,
    stream: Literal["base", "queries"] = "base",
    path: Path | None = None,
    progress: bool = False,
) -> np.ndarray:
    """``n`` clustered unit vectors, float32 ``(n, dim)``.

    With ``path`` the array is written there as a ``.npy`` memory map (1M x 384 is 1.5 GB)
    and returned as ``np.memmap``; without it, in memory. ``stream="queries"`` draws held-out
    points from the same distribution (same centres) for use as queries.
    """
    if n < 1 or dim < 1 or n_clusters < 1:
        raise InvalidInputError(f"n, dim and n_clusters must be positive (got {n}, {dim}, {n_clusters})", "e.g. n=100000, dim=384")
    if noise < 0:
        raise InvalidInputError(f"noise must be >= 0, got {noise}", "0.6 gives a within-cluster cosine of about 0.74")
    if stream not in _STREAMS:
        raise InvalidInputError(f"unknown stream {stream!r}", "use 'base' or 'queries'")
    centres, probs = cluster_model(dim, n_clusters, seed)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        out: np.ndarray = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, dim))
    else:
        out = np.empty((n, dim), dtype=np.float32)
    blocks = range((n + BLOCK - 1) // BLOCK)
    if progress:
        import sys

        from tqdm import tqdm

        blocks = tqdm(blocks, desc=f"generate {stream}", unit=" blocks", file=sys.stderr)
    for b in blocks:
        lo, hi = b * BLOCK, min(n, (b + 1) * BLOCK)
        out[lo:hi] = _block(b, hi - lo, centres, probs, noise, seed, _STREAMS[stream])
    if isinstance(out, np.memmap):
        out.flush()
    return out


def exact_ground_truth(
    base: np.ndarray, queries: np.ndarray, k: int = 100, *, chunk: int = 262_144, progress: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-``k`` by inner product: ``(scores float32 (nq, k), ids int64 (nq, k))``, best first.

    ``base`` is scanned in chunks of ``chunk`` rows with a FAISS ``IndexFlatIP`` each, so a
    memory-mapped base never has to be in memory at once; per-chunk results are merged
    exactly. Ties are ordered by ascending id.
    """
    import faiss

    base_n, dim = base.shape
    if queries.ndim != 2 or queries.shape[1] != dim:
        raise InvalidInputError(f"queries have shape {queries.shape}, base has dim {dim}", "queries and base must share the dimension")
    if not 1 <= k <= base_n:
        raise InvalidInputError(f"k={k} but the base has {base_n} vectors", "choose 1 <= k <= len(base)")
    q = np.ascontiguousarray(queries, dtype=np.float32)
    nq = len(q)
    best_s = np.full((nq, 0), -np.inf, dtype=np.float32)
    best_i = np.zeros((nq, 0), dtype=np.int64)
    starts = range(0, base_n, chunk)
    if progress:
        import sys

        from tqdm import tqdm

        starts = tqdm(starts, desc="exact top-k", unit=" chunks", file=sys.stderr)
    for lo in starts:
        block = np.ascontiguousarray(base[lo : lo + chunk], dtype=np.float32)
        index = faiss.IndexFlatIP(dim)
        index.add(block)
        s, i = index.search(q, min(k, len(block)))
        cand_s = np.concatenate([best_s, s], axis=1)
        cand_i = np.concatenate([best_i, i.astype(np.int64) + lo], axis=1)
        # Sort by score descending, then id ascending, so ties break the same way every run.
        order = np.lexsort((cand_i, -cand_s), axis=1)[:, :k]
        best_s = np.take_along_axis(cand_s, order, axis=1)
        best_i = np.take_along_axis(cand_i, order, axis=1)
    return best_s, best_i

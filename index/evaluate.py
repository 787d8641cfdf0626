"""How good and how costly an index configuration is: recall@k against exact search over the
stored fp32 (from float16) full-dimension vectors, bytes per document and single-query
latency; plus a synthetic embedding generator for measuring without a model.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from qswap.index.backends.faiss.index import DocumentIndex

# Scores closer than this are ties: BLAS and FAISS sum in different orders.
_TIE = 1e-5


def synthetic_embeddings(n: int, dim: int, seed: int = 0, rank: int = 64, clusters: int = 200) -> np.ndarray:
    """(n, dim) unit rows with embedding-like structure: clustered, low-rank, Matryoshka-ordered.

    Rows are cluster centre + spread in a ``rank``-dimensional latent space, mapped to
    ``dim`` by a random matrix whose output variance decays with the coordinate index (so
    prefixes carry most of the signal, as in Matryoshka-trained models), plus isotropic
    noise. Uniform random vectors would make every neighbour equally far and ANN
    measurements meaningless.
    """
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, rank)) * 1.0
    z = centres[rng.integers(0, clusters, n)] + rng.standard_normal((n, rank)) * 0.8
    decay = 1.0 / np.sqrt(1.0 + np.arange(dim) / 16.0)
    a = rng.standard_normal((rank, dim)) * decay
    x = z @ a + rng.standard_normal((n, dim)) * 0.3 * decay
    x = x.astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def perturbed_queries(index: DocumentIndex, n: int, seed: int = 0, noise: float = 0.6) -> np.ndarray:
    """Queries near stored documents: a random document's vector plus Gaussian noise of
    norm about ``noise``, renormalised (cosine to the source document ~ 0.85 at 0.6)."""
    x = index.sample_embeddings(n, seed)
    rng = np.random.default_rng(seed + 1)
    g = rng.standard_normal(x.shape).astype(np.float32) * (noise / np.sqrt(x.shape[1]))
    q = x + g
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def evaluate(index: DocumentIndex, queries: np.ndarray | None = None, *, n_queries: int = 1000, k: int = 10,
             latency_queries: int = 200, seed: int = 0, batch: int = 256) -> dict[str, Any]:
    """Recall@k vs exact fp32 full-dimension search, bytes per document, latency.

    Without ``queries``, ``n_queries`` perturbed document vectors are used
    (:func:`perturbed_queries`). Latency is of ``index.search`` on one query with text, as
    the server calls it (p50/p99 over ``latency_queries`` after a warm-up).
    """
    q = perturbed_queries(index, n_queries, seed) if queries is None else np.asarray(queries, np.float32)
    recalls = []
    t_batch = 0.0
    for i in range(0, len(q), batch):
        qb = q[i:i + batch]
        truth = index.search_exact(qb, k)
        t = time.perf_counter()
        got = index.search(qb, k, with_text=False)
        t_batch += time.perf_counter() - t
        ids = sorted({h.id for hits in got for h in hits})
        vecs = dict(zip(ids, index.get_embeddings(ids))) if ids else {}
        qn = qb / np.linalg.norm(qb, axis=1, keepdims=True)
        for qi, tr, g in zip(qn, truth, got):
            if not tr:
                continue
            want = {h.id for h in tr}
            # A hit tied with the k-th true neighbour (within float error) counts as correct.
            floor = tr[-1].score - _TIE
            good = sum(h.id in want or float(vecs[h.id] @ qi) >= floor for h in g[:len(tr)])
            recalls.append(good / len(tr))
    lat = []
    m = min(latency_queries, len(q))
    for j in range(min(10, m)):
        index.search(q[j:j + 1], k)
    for j in range(m):
        t = time.perf_counter()
        index.search(q[j:j + 1], k)
        lat.append((time.perf_counter() - t) * 1000)
    info = index.info()
    return {
        "documents": index.count,
        "config": {key: info["config"][key] for key in ("kind", "quant", "dim", "nlist", "nprobe", "hnsw_m",
                                                         "ef_search", "pq_m", "rescore", "oversample")},
        "factory": info["faiss"]["factory"],
        "rescoring": info["rescoring"],
        "queries": len(q),
        "k": k,
        f"recall@{k}": float(np.mean(recalls)) if recalls else float("nan"),
        "bytes_per_doc": {key: round(v, 1) for key, v in info["bytes_per_doc"].items()},
        "latency_ms": {"p50": float(np.percentile(lat, 50)) if lat else float("nan"),
                       "p99": float(np.percentile(lat, 99)) if lat else float("nan")},
        "batch_qps": len(q) / t_batch if t_batch > 0 else float("nan"),
    }

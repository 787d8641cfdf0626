"""FAISS indexes for an :class:`~qswap.index.config.IndexConfig`: factory strings, training,
id bookkeeping, filtered search and the GPU path.

FAISS ids are rows of the embedding log. Flat and HNSW indexes wrap their storage in
``IndexIDMap2``; IVF indexes keep ids natively (``IndexIDMap2.remove_ids`` assumes the inner
index renumbers after a removal, which IVF does not). HNSW cannot remove vectors: the store
keeps removed rows as tombstones and excludes them with an ID selector.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from qswap.index.errors import IndexCorruptError
from qswap.errors import InvalidInputError
from qswap.atomic import atomic_write_via
from qswap.index.config import IndexConfig
from qswap.index.backends.faiss.embeddings import EmbeddingStore
from qswap.matryoshka import truncate

log = logging.getLogger("qswap.index")

METRIC = "inner_product"
# Fewer points than this per IVF list make k-means centroids meaningless (FAISS warns at 39).
MIN_POINTS_PER_LIST = 39
# Training sample caps: enough for stable SQ ranges, k-means and PQ codebooks.
_SQ_TRAIN = 100_000
_PQ_TRAIN = 65_536
_PQ_MIN_POINTS_PER_CODE = 8
# GPU k-selection is limited to 2048 in FAISS.
_GPU_MAX_K = 2048


@dataclass(frozen=True)
class FaissPlan:
    """What will actually be built: the factory string and the clamped parameters."""

    factory: str
    nlist: int | None
    pq_nbits: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"factory": self.factory, "nlist": self.nlist, "pq_nbits": self.pq_nbits}


def plan(config: IndexConfig, n_train: int) -> FaissPlan:
    """Factory string for a resolved config and a training set of ``n_train`` vectors."""
    if config.kind is None or config.quant is None or config.dim is None:
        raise InvalidInputError("index config is not resolved", "call IndexConfig.resolve(n_docs, full_dim) first")
    n = max(int(n_train), 1)
    pq_nbits = None
    if config.quant == "pq":
        # 2**nbits centroids per sub-quantiser, each trained on >= 8 points: full 8-bit
        # codes from 2048 documents, fewer bits (coarser, but trainable and fast) below.
        pq_nbits = max(1, min(8, int(math.log2(max(n / _PQ_MIN_POINTS_PER_CODE, 2.0)))))
        storage = f"PQ{config.pq_m}x{pq_nbits}"
    else:
        storage = {"fp32": "Flat", "fp16": "SQfp16", "sq8": "SQ8", "sq4": "SQ4"}[config.quant]
    nlist = None
    if config.kind == "flat":
        factory = f"IDMap2,{storage}"
    elif config.kind == "hnsw":
        factory = f"IDMap2,HNSW{config.hnsw_m},{storage}"
    else:
        nlist = max(1, min(int(config.nlist or 1), n // MIN_POINTS_PER_LIST))
        factory = f"IVF{nlist},{storage}"
    return FaissPlan(factory, nlist, pq_nbits)


def new_index(config: IndexConfig, p: FaissPlan) -> faiss.Index:
    index = faiss.index_factory(int(config.dim), p.factory, faiss.METRIC_INNER_PRODUCT)
    inner = _inner(index)
    if isinstance(inner, faiss.IndexHNSW):
        inner.hnsw.efConstruction = int(config.ef_construction or 40)
    return index


def build(config: IndexConfig, store: EmbeddingStore, rows: np.ndarray,
          progress: bool = False, seed: int = 0) -> tuple[faiss.Index, FaissPlan]:
    """Train (on a seeded sample) and fill a new index with ``rows`` of ``store``."""
    rows = np.asarray(rows, dtype=np.int64)
    # Train on every stored row, retired versions included: they come from the same corpus
    # and keep training possible when few (or no) documents are live.
    pool = np.arange(store.rows_total, dtype=np.int64) if store.rows_total > len(rows) else rows
    p = plan(config, len(pool))
    index = new_index(config, p)
    dim = int(config.dim)
    if not index.is_trained:
        if len(pool) == 0:
            raise InvalidInputError("no vectors to train the index on", "add documents first")
        cap = max(_SQ_TRAIN, _PQ_TRAIN, 256 * (p.nlist or 1))
        rng = np.random.default_rng(seed)
        sample = pool if len(pool) <= cap else np.sort(rng.choice(pool, cap, replace=False))
        index.train(truncate(store.gather(sample), dim))
    bar = None
    if progress and len(rows) > 0:
        from tqdm import tqdm
        import sys
        bar = tqdm(total=len(rows), unit="doc", desc="indexing", file=sys.stderr, dynamic_ncols=True)
    for r, x in store.iter_rows(rows):
        index.add_with_ids(truncate(x, dim), r)
        if bar is not None:
            bar.update(len(r))
    if bar is not None:
        bar.close()
    return index, p


def _inner(index: faiss.Index) -> faiss.Index:
    index = faiss.downcast_index(index)
    if isinstance(index, (faiss.IndexIDMap2, faiss.IndexIDMap)):
        return faiss.downcast_index(index.index)
    return index


def ids_of(index: faiss.Index) -> np.ndarray:
    """Every id stored in ``index`` (IDMap2 or IVF)."""
    index = faiss.downcast_index(index)
    if isinstance(index, (faiss.IndexIDMap2, faiss.IndexIDMap)):
        return faiss.vector_to_array(index.id_map).astype(np.int64)
    ivf = faiss.extract_index_ivf(index)
    inv = ivf.invlists
    parts = []
    for lst in range(ivf.nlist):
        size = inv.list_size(lst)
        if size:
            ptr = inv.get_ids(lst)
            parts.append(faiss.rev_swig_ptr(ptr, size).astype(np.int64).copy())
            inv.release_ids(lst, ptr)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def can_remove(index: faiss.Index) -> bool:
    return not isinstance(_inner(index), faiss.IndexHNSW)


def can_select(index: faiss.Index) -> bool:
    """Whether a search may carry an ID selector (flat PQ rejects search parameters)."""
    return not isinstance(_inner(index), faiss.IndexPQ)


def remove(index: faiss.Index, rows: np.ndarray) -> int:
    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) == 0:
        return 0
    return int(index.remove_ids(faiss.IDSelectorBatch(rows)))


def clone(index: faiss.Index) -> faiss.Index:
    """A deep copy of ``index`` (what a commit changes while searches go on over the original)."""
    return faiss.clone_index(index)


def add(index: faiss.Index, rows: np.ndarray, vectors: np.ndarray, dim: int) -> None:
    if len(rows):
        index.add_with_ids(truncate(vectors, dim), np.asarray(rows, dtype=np.int64))


@dataclass
class Selector:
    """An ID selector and the buffers it points into (kept alive while FAISS reads them)."""

    sel: Any
    keep: list[Any] = field(default_factory=list)


def bitmap_selector(rows: np.ndarray, universe: int, exclude: bool = False) -> Selector:
    """Select (or, with ``exclude``, reject) ``rows`` among ids ``0 .. universe-1``."""
    mask = np.zeros(max(int(universe), 1), dtype=bool)
    mask[np.asarray(rows, dtype=np.int64)] = True
    bits = np.packbits(mask, bitorder="little")
    inner = faiss.IDSelectorBitmap(bits)
    if not exclude:
        return Selector(inner, [bits])
    return Selector(faiss.IDSelectorNot(inner), [bits, inner])


def limit_threads(n: int) -> None:
    """At most ``n`` OpenMP threads for the FAISS calls the calling thread makes from now on
    (OpenMP's thread count is a setting of each thread)."""
    faiss.omp_set_num_threads(max(1, int(n)))


def search(index: faiss.Index, queries: np.ndarray, k: int, config: IndexConfig,
           selector: Selector | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One batched FAISS search; scores are inner products (L2 results are converted)."""
    inner = _inner(index)
    kw: dict[str, Any] = {}
    if selector is not None:
        kw["sel"] = selector.sel
    if isinstance(inner, faiss.IndexHNSW):
        params = faiss.SearchParametersHNSW(efSearch=max(int(config.ef_search or 16), k), **kw)
    elif isinstance(inner, faiss.IndexIVF):
        params = faiss.SearchParametersIVF(nprobe=min(int(config.nprobe or 1), inner.nlist), **kw)
    elif kw:
        params = faiss.SearchParameters(**kw)
    else:
        params = None
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if len(q) == 1 and faiss.omp_get_max_threads() > 1:
        # FAISS parallelises flat, IVF and HNSW searches over queries: for one query a second
        # OpenMP thread has nothing to do but still has to be woken (and, next to a spinning
        # encoder thread pool, wait for a core). The setting is per calling thread.
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(1)
        try:
            d, i = index.search(q, k, params=params)
        finally:
            faiss.omp_set_num_threads(threads)
    else:
        d, i = index.search(q, k, params=params)
    if inner.metric_type == faiss.METRIC_L2:
        # HNSW-PQ ignores the metric argument; on unit vectors |q-x|^2 = 2 - 2 q.x
        d = 1.0 - d / 2.0
    return d, i


# ---------------------------------------------------------------------- files
def write(index: faiss.Index, path: Path) -> str:
    """Atomically write ``index``; returns the file's sha256."""
    return atomic_write_via(Path(path), lambda tmp: faiss.write_index(index, tmp))


def read(path: Path) -> faiss.Index:
    try:
        return faiss.read_index(str(path))
    except RuntimeError as e:
        raise IndexCorruptError(f"FAISS file {Path(path).name} cannot be read ({str(e).splitlines()[0][:120]})",
                             "restore the index folder or rebuild it") from None


def nbytes(index: faiss.Index) -> int:
    """Serialized size: what the index costs in memory, ids and graph included."""
    return int(faiss.serialize_index(index).nbytes)


# ---------------------------------------------------------------------- GPU
def gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


@dataclass
class GpuIndex:
    index: Any
    resources: Any


def to_gpu(index: faiss.Index, config: IndexConfig) -> GpuIndex | None:
    """A GPU copy of a flat or IVF index when faiss sees a GPU, else ``None``.

    The CPU index stays the master copy (mutations, saving); the caller drops the GPU copy
    after every change and makes a new one on the next search.
    """
    if not config.use_gpu or config.kind not in ("flat", "ivf"):
        return None
    if not gpu_available():
        return _torch_gpu(index, config)
    if config.quant == "pq" and config.kind == "flat":
        return None
    try:
        res = faiss.StandardGpuResources()
        opts = faiss.GpuClonerOptions()
        opts.useFloat16 = config.quant == "fp16"
        return GpuIndex(faiss.index_cpu_to_gpu(res, 0, index, opts), res)
    except Exception as e:  # noqa: BLE001 - any FAISS/CUDA failure means: stay on the CPU
        log.warning("GPU search unavailable for %s/%s, using the CPU: %s", config.kind, config.quant, e)
        return None


@functools.lru_cache(maxsize=1)
def _say_no_faiss_gpu() -> None:
    """Say once per process why FAISS searches on the CPU although there is a GPU."""
    log.warning("faiss has no GPU support here (faiss-cpu): large flat indexes are searched on the GPU with torch, "
                "IVF and smaller indexes on the CPU; pip install 'qswap[gpu]' (faiss-gpu-cu12) where a wheel exists "
                "for this platform and CUDA version")


def _torch_gpu(index: faiss.Index, config: IndexConfig) -> GpuIndex | None:
    """Without faiss-gpu: a large flat index's exact top-k on a CUDA device through torch."""
    import sys
    # A process that never loaded torch (an index-only tool) holds no GPU context: do not start one.
    torch = sys.modules.get("torch")
    if config.kind != "flat" or torch is None or not torch.cuda.is_available():
        return None
    from qswap.index.backends.faiss.torch_flat import torch_flat
    _say_no_faiss_gpu()
    try:
        flat = torch_flat(index, str(config.quant))
    except Exception as e:  # noqa: BLE001 - any CUDA failure (memory) means: stay on the CPU
        log.warning("torch GPU search unavailable for %s/%s, using the CPU: %s", config.kind, config.quant, e)
        return None
    return None if flat is None else GpuIndex(flat, None)


def gpu_can_search(k: int) -> bool:
    return k <= _GPU_MAX_K


def gpu_search(g: GpuIndex, queries: np.ndarray, k: int, config: IndexConfig) -> tuple[np.ndarray, np.ndarray]:
    """Search the GPU copy (no selectors on the GPU: filtered searches stay on the CPU)."""
    if config.kind == "ivf":
        faiss.GpuParameterSpace().set_index_parameter(g.index, "nprobe", int(config.nprobe or 1))
    return g.index.search(np.ascontiguousarray(queries, dtype=np.float32), k)

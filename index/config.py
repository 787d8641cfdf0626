"""Index options: one dataclass, with defaults chosen by corpus size.

Every field left ``None`` is filled by :meth:`IndexConfig.resolve` from the corpus size and
the embedding dimension; the resolved config is what an index records in its manifest.
Build-shape options (``dim``, ``quant``, ``kind``, ``nlist``, ``hnsw_m``, ``ef_construction``,
``pq_m``) need a re-index to change; search-time options (``nprobe``, ``ef_search``,
``rescore``, ``oversample``) take effect at once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from qswap.errors import InvalidInputError

QUANTS = ("fp32", "fp16", "sq8", "sq4", "pq")
KINDS = ("flat", "hnsw", "ivf")

# Options of a build run, not of the index it makes (never merged into an index's config).
BUILD_ONLY = ("batch_size", "chunk_rows")

# Corpus sizes at which the defaults change: exact search is cheap up to SMALL documents,
# HNSW + SQ8 serves up to LARGE, beyond that IVF keeps memory and build time in check.
SMALL = 50_000
LARGE = 1_000_000


@dataclass(frozen=True)
class IndexConfig:
    """How the FAISS side of an index is built and searched.

    ``None`` means "choose by corpus size" (see :meth:`for_corpus`).
    """

    dim: int | None = None              # Matryoshka prefix kept in FAISS (renormalised)
    quant: str | None = None            # fp32 | fp16 | sq8 | sq4 | pq
    kind: str | None = None             # flat | hnsw | ivf
    nlist: int | None = None            # IVF lists (clamped to what the corpus can train)
    nprobe: int | None = None           # IVF lists visited per query
    hnsw_m: int | None = None           # HNSW neighbours per node
    ef_construction: int | None = None  # HNSW build beam
    ef_search: int | None = None        # HNSW search beam (raised to the fetch size if smaller)
    pq_m: int | None = None             # PQ sub-quantisers (must divide dim)
    rescore: bool | None = None         # re-rank candidates with the stored fp16 full-dim vectors
    oversample: int | None = None       # candidates fetched = k * oversample when rescoring
    use_gpu: bool | None = None         # search flat/IVF on a GPU when faiss sees one (default on)
    # Build-only options: they shape how a build runs, not the index it makes, so they are
    # recorded with the build (manifest "build"), never in the index's config.
    batch_size: int = 64                # texts per embed call during a build
    chunk_rows: int = 4096              # rows per resumable embedding chunk during a build

    # ------------------------------------------------------------------ defaults
    @classmethod
    def for_corpus(cls, n_docs: int, full_dim: int, **overrides: Any) -> "IndexConfig":
        """Resolved defaults for ``n_docs`` documents of ``full_dim`` dimensions, with overrides."""
        return cls(**overrides).resolve(n_docs, full_dim)

    def resolve(self, n_docs: int, full_dim: int) -> "IndexConfig":
        """Fill every ``None`` field for a corpus of ``n_docs`` and validate the result."""
        if full_dim < 1:
            raise InvalidInputError(f"embedding dimension must be positive, got {full_dim}",
                                    "check the embedding space of the base model")
        self.validate(full_dim)  # before defaults, so that dim=0 is an error, not "unset"
        n = max(int(n_docs), 1)
        if n <= SMALL:
            kind, quant, dim = "flat", "fp32", full_dim
        elif n <= LARGE:
            kind, quant, dim = "hnsw", "sq8", full_dim
        else:
            kind, quant, dim = "ivf", "sq8", min(full_dim, 256)
        c = self
        kind = c.kind or kind
        quant = c.quant or quant
        dim = c.dim or dim
        nlist = c.nlist or _pow2(4 * math.sqrt(n))
        pq_m = c.pq_m or _pq_default(dim)
        resolved = replace(
            c, kind=kind, quant=quant, dim=dim, nlist=nlist, pq_m=pq_m,
            nprobe=c.nprobe or (32 if n > LARGE else 16),
            hnsw_m=c.hnsw_m or 32,
            ef_construction=c.ef_construction or 80,
            ef_search=c.ef_search or 64,
            rescore=True if c.rescore is None else c.rescore,
            oversample=c.oversample or (8 if n > LARGE else 4),
            use_gpu=True if c.use_gpu is None else c.use_gpu,
        )
        resolved.validate(full_dim)
        return resolved

    # ------------------------------------------------------------------ checks
    def validate(self, full_dim: int | None = None) -> None:
        """Raise :class:`InvalidInputError` for an option that cannot work."""
        hint = "see `qswap index build --help` for the allowed values"
        if self.quant is not None and self.quant not in QUANTS:
            raise InvalidInputError(f"unknown quant {self.quant!r} (allowed: {', '.join(QUANTS)})", hint)
        if self.kind is not None and self.kind not in KINDS:
            raise InvalidInputError(f"unknown index kind {self.kind!r} (allowed: {', '.join(KINDS)})", hint)
        for name in ("dim", "nlist", "nprobe", "hnsw_m", "ef_construction", "ef_search",
                     "pq_m", "oversample", "batch_size", "chunk_rows"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise InvalidInputError(f"{name} must be a positive integer, got {v!r}", hint)
        if self.hnsw_m is not None and self.hnsw_m < 2:
            raise InvalidInputError(f"hnsw_m must be at least 2, got {self.hnsw_m}", hint)
        if full_dim is not None and self.dim is not None and self.dim > full_dim:
            raise InvalidInputError(
                f"dim {self.dim} exceeds the embedding dimension {full_dim}",
                f"choose a Matryoshka prefix of at most {full_dim}")
        if self.quant == "pq" and self.dim is not None and self.pq_m is not None and self.dim % self.pq_m:
            raise InvalidInputError(f"pq_m {self.pq_m} does not divide dim {self.dim}",
                                    "choose pq_m among the divisors of dim (e.g. dim // 8)")

    @property
    def is_exact(self) -> bool:
        """True when FAISS itself scores exactly (flat fp32); rescoring adds nothing then."""
        return self.kind == "flat" and self.quant == "fp32"

    def rescores(self, full_dim: int) -> bool:
        """Whether candidates are rescored with the stored full-dimension vectors: when asked,
        unless the search itself is exact over every dimension."""
        return bool(self.rescore) and not (self.is_exact and self.dim == full_dim)

    # ------------------------------------------------------------------ records
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def index_dict(self) -> dict[str, Any]:
        """The options that describe the index (what a manifest records): no build-only ones."""
        return {k: v for k, v in asdict(self).items() if k not in BUILD_ONLY}

    def merged_into(self, current: "IndexConfig") -> "IndexConfig":
        """``current`` with every index option set here (not ``None``) replacing its value.

        Any given value counts, the class default included (``use_gpu=True`` switches the GPU
        back on); build-only options never carry over into an existing index.
        """
        given = {k: v for k, v in self.index_dict().items() if v is not None}
        merged = {**current.index_dict(), **given}
        if "dim" in given and "pq_m" not in given:
            merged["pq_m"] = None  # PQ sub-quantisers follow dim unless given
        return IndexConfig(**merged)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "IndexConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise InvalidInputError(f"unknown index options {sorted(unknown)}",
                                    "the manifest was written by a newer qswap; upgrade qswap")
        return cls(**{k: v for k, v in d.items() if k in names})


def _pow2(x: float) -> int:
    """Nearest power of two (IVF list counts), at least 1."""
    return max(1, 2 ** round(math.log2(max(x, 1.0))))


def _pq_default(dim: int) -> int:
    """Largest divisor of dim not above dim // 8: about one byte per 8 dimensions."""
    target = max(1, dim // 8)
    for m in range(target, 0, -1):
        if dim % m == 0:
            return m
    return 1

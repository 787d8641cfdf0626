"""The full-precision embedding log: float16 rows in immutable chunk files, memory-mapped.

Row ``r`` of the log is the FAISS id of the document stored at row ``r`` of the document
store. Rows are only ever appended (an upsert writes a new row and retires the old one),
so a chunk never changes after it is written and its sha256 in the manifest stays valid.
Small chunks from single additions are merged, like a binary counter, so the number of
files (and open maps) stays logarithmic in the number of additions.

These vectors are the source of truth: rescoring reads them, re-indexing with other
options reads them, tuning reads them; nothing embeds the corpus twice.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qswap.atomic import atomic_stream, sha256_file
from qswap.index.checks import row_norms
from qswap.index.errors import IndexCorruptError

DTYPE = np.float16
EMB_DIR = "emb"


@dataclass(frozen=True)
class Chunk:
    """One immutable file of consecutive rows ``[start, start + rows)``."""

    file: str       # relative to the index folder
    start: int
    rows: int
    sha256: str

    @property
    def end(self) -> int:
        return self.start + self.rows

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "start": self.start, "rows": self.rows, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Chunk":
        return cls(str(d["file"]), int(d["start"]), int(d["rows"]), str(d["sha256"]))


def chunk_name(start: int, end: int, generation: int) -> str:
    """File name of a chunk: its row range and the generation that wrote it (unique)."""
    return f"{EMB_DIR}/{start:012d}-{end:012d}.g{generation:08d}.f16"


class EmbeddingStore:
    """Read side of the log: chunk memmaps and row gathering."""

    def __init__(self, root: Path, full_dim: int, chunks: Sequence[Chunk],
                 _maps: dict[str, np.ndarray] | None = None) -> None:
        self.root = Path(root)
        self.full_dim = full_dim
        self.chunks = list(chunks)
        expected = 0
        for c in self.chunks:
            if c.start != expected:
                raise IndexCorruptError(f"embedding chunks are not contiguous at row {expected} ({c.file})",
                                     "the manifest is damaged; rebuild the index")
            expected = c.end
        self.rows_total = expected
        self._maps: dict[str, np.ndarray] = {}
        for c in self.chunks:
            if _maps and c.file in _maps:
                self._maps[c.file] = _maps[c.file]
            else:
                self._maps[c.file] = self._open(c)
        self._starts = np.array([c.start for c in self.chunks], dtype=np.int64)
        # Plain arrays over the same maps: indexing an np.memmap runs its subclass hooks on
        # every result (~40 us of a one-query search's rescoring).
        self._views = [np.asarray(self._maps[c.file]) for c in self.chunks]

    def _open(self, c: Chunk) -> np.ndarray:
        p = self.root / c.file
        if not p.is_file():
            raise IndexCorruptError(f"embedding file {c.file} is missing", "restore the index folder or rebuild it")
        want = c.rows * self.full_dim * np.dtype(DTYPE).itemsize
        got = p.stat().st_size
        if got != want:
            raise IndexCorruptError(f"embedding file {c.file} has {got} bytes, expected {want}",
                                 "the file is truncated or replaced; restore it or rebuild the index")
        if c.rows == 0:
            return np.zeros((0, self.full_dim), dtype=DTYPE)
        return np.memmap(p, dtype=DTYPE, mode="r", shape=(c.rows, self.full_dim))

    def with_chunks(self, chunks: Sequence[Chunk]) -> "EmbeddingStore":
        """A store over ``chunks`` that reuses the maps of chunks it shares with this one."""
        return EmbeddingStore(self.root, self.full_dim, chunks, _maps=self._maps)

    def verify(self) -> None:
        """Compare every chunk's sha256 with the manifest; :class:`IndexCorruptError` on a mismatch."""
        for c in self.chunks:
            got = sha256_file(self.root / c.file)
            if got != c.sha256:
                raise IndexCorruptError(f"embedding file {c.file}: sha256 {got[:12]}... != manifest {c.sha256[:12]}...",
                                     "the file was modified or damaged; restore it or rebuild the index")

    def gather16(self, rows: np.ndarray) -> np.ndarray:
        """Rows (any order, repeats allowed) as float16 (n, full_dim)."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            return np.empty((0, self.full_dim), dtype=DTYPE)
        if rows.min() < 0 or rows.max() >= self.rows_total:
            raise IndexCorruptError(f"embedding row out of range (have {self.rows_total} rows)",
                                 "the document store and the embeddings disagree; rebuild the index")
        if len(self._views) == 1:   # one chunk (an index as built): rows are its offsets
            return self._views[0][rows]
        out = np.empty((len(rows), self.full_dim), dtype=DTYPE)
        which = np.searchsorted(self._starts, rows, side="right") - 1
        for ci in np.unique(which):
            sel = which == ci
            out[sel] = self._views[ci][rows[sel] - self.chunks[ci].start]
        return out

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """Rows as float32 (n, full_dim), renormalised.

        float16 rounding leaves norms off 1 by ~1e-4; renormalising makes every consumer
        (FAISS, rescoring, exact search) score the same unit vector, so scores agree exactly.
        """
        x = self.gather16(rows).astype(np.float32)
        norms = row_norms(x)
        norms[norms == 0] = 1.0   # a zero row stays zero rather than NaN
        return x / norms

    def iter_rows(self, rows: np.ndarray, block: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(rows, float32 vectors) in blocks, for building or brute-force scans."""
        rows = np.asarray(rows, dtype=np.int64)
        for i in range(0, len(rows), block):
            r = rows[i:i + block]
            yield r, self.gather(r)

    # ------------------------------------------------------------------ writing
    @staticmethod
    def write_chunk(root: Path, start: int, data: np.ndarray, generation: int) -> Chunk:
        """Write rows ``[start, start + len(data))`` as a new chunk file (atomic)."""
        a = np.ascontiguousarray(data, dtype=DTYPE)
        name = chunk_name(start, start + len(a), generation)
        with atomic_stream(Path(root) / name) as w:
            w.write(memoryview(a).cast("B"))
        return Chunk(name, start, len(a), w.sha.hexdigest())

    @staticmethod
    def plan_merge(chunks: Sequence[Chunk]) -> int | None:
        """Index ``i`` such that ``chunks[i:]`` should be merged into one, or ``None``.

        Binary-counter rule: a chunk is merged with everything after it while it holds at
        most twice as many rows as they do together, so each row is copied O(log n) times.
        """
        if len(chunks) < 2:
            return None
        i = len(chunks) - 1
        acc = chunks[i].rows
        while i >= 1 and chunks[i - 1].rows <= 2 * acc:
            i -= 1
            acc += chunks[i].rows
        return i if i < len(chunks) - 1 else None

    def merge(self, chunks: Sequence[Chunk], generation: int, block: int = 65536) -> Chunk:
        """Concatenate consecutive chunks of this store into one new file (atomic)."""
        start, end = chunks[0].start, chunks[-1].end
        name = chunk_name(start, end, generation)
        with atomic_stream(self.root / name) as w:
            for c in chunks:
                m = self._maps[c.file] if c.file in self._maps else self._open(c)
                for i in range(0, c.rows, block):
                    w.write(memoryview(np.ascontiguousarray(m[i:i + block])).cast("B"))
        return Chunk(name, start, end - start, w.sha.hexdigest())

"""The document store: SQLite rows (row, external id, text, metadata JSON) tagged by generation.

Each row records the generation that added it and the one that deleted it. The manifest
names the committed generation ``g``; a reader sees exactly the rows live at ``g``
(``added_gen <= g`` and not deleted by ``g``). A writer killed after its SQLite commit but
before its manifest leaves rows of generation ``g + 1``: they are invisible to readers and
the next writer rolls them back, so SQLite can be changed in place and still stay in step
with the manifest.

The manifest cannot hold a file sha256 for a database changed in place, so it holds a
content digest instead: the sum (mod 2**128) of a hash of every live record. It is kept
up to date incrementally and recomputed when an index is opened.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from qswap.index.errors import IndexCorruptError
from qswap.errors import InvalidInputError
from qswap.index.checks import check_filter, check_ids, json_path

DOCS_FILE = "docs.sqlite"
SCHEMA_VERSION = 1
_MOD = 1 << 128
# SQLite's default limit on bound parameters is 32766 in 3.32+; stay well below.
_IN_BATCH = 900

_SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (
    row INTEGER PRIMARY KEY,      -- row in the embedding log = FAISS id
    id TEXT NOT NULL,             -- external id
    text TEXT NOT NULL,
    meta TEXT NOT NULL,           -- JSON object
    added_gen INTEGER NOT NULL,
    deleted_gen INTEGER           -- NULL while live
);
CREATE UNIQUE INDEX IF NOT EXISTS docs_live_id ON docs(id) WHERE deleted_gen IS NULL;
CREATE INDEX IF NOT EXISTS docs_id ON docs(id);
CREATE TABLE IF NOT EXISTS info (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

_LONG_DIGITS = re.compile(r"[0-9]{19}")   # an integer that may not fit 64 bits (see meta_of)
_LIVE = "added_gen <= ? AND (deleted_gen IS NULL OR deleted_gen > ?)"

Scalar = str | int | float | bool


def meta_json(metadata: dict[str, Any]) -> str:
    """Canonical JSON of a metadata object (what is stored and hashed)."""
    return json.dumps(metadata, sort_keys=True, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def meta_of(stored: str) -> dict[str, Any]:
    """The metadata object of its stored JSON (:func:`meta_json`).

    orjson reads the ten objects of a search's hits in a fifth of ``json.loads``'s time, to the
    same values, except integers beyond 64 bits, which it reads as floats: JSON holding a run
    of 19 digits or more is read by ``json.loads``, as before.
    """
    if _LONG_DIGITS.search(stored):
        return json.loads(stored)
    return orjson.loads(stored)


@functools.lru_cache(maxsize=64)
def _fetch_sql(n: int, with_text: bool) -> str:
    """The SELECT of :meth:`DocStore.fetch` for ``n`` rows (built once per size)."""
    cols = "row, id, text, meta" if with_text else "row, id, NULL, meta"
    return f"SELECT {cols} FROM docs WHERE row IN ({','.join('?' * n)}) AND {_LIVE}"


def record_hash(row: int, doc_id: str, text: str, meta: str) -> int:
    """128-bit hash of one stored record, summed into the store digest."""
    h = hashlib.sha256(f"{row}\x1f{doc_id}\x1f{text}\x1f{meta}".encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest()[:16], "big")


def digest_hex(value: int) -> str:
    return f"{value % _MOD:032x}"


def _chunks(seq: list[Any], n: int = _IN_BATCH) -> Iterator[list[Any]]:
    for i in range(0, len(seq), n):
        yield seq[i:i + n]


def filter_sql(flt: dict[str, Scalar]) -> tuple[str, list[Any]]:
    """SQL condition (and parameters) for equality on top-level metadata fields.

    Types are compared strictly: ``True`` matches JSON ``true`` only, ``1`` matches the
    numbers 1 and 1.0, ``"1"`` matches the string "1".
    """
    check_filter(flt)
    parts: list[str] = []
    params: list[Any] = []
    for field, value in flt.items():
        path = json_path(field)
        if isinstance(value, bool):
            parts.append("json_type(meta, ?) = ?")
            params += [path, "true" if value else "false"]
        elif isinstance(value, (int, float)):
            if isinstance(value, float) and not np.isfinite(value):
                raise InvalidInputError(f"filter {field}: {value} is not a finite number", "use a finite number")
            parts.append("json_type(meta, ?) IN ('integer', 'real') AND json_extract(meta, ?) = ?")
            params += [path, path, value]
        elif isinstance(value, str):
            parts.append("json_type(meta, ?) = 'text' AND json_extract(meta, ?) = ?")
            params += [path, path, value]
        elif value is None:
            parts.append("json_type(meta, ?) = 'null'")
            params += [path]
        else:
            raise InvalidInputError(
                f"filter {field}: unsupported value type {type(value).__name__}",
                "filters compare a field with one string, number, boolean or null")
    return (" AND ".join(parts) if parts else "1"), params


class DocStore:
    """SQLite document table with generation-tagged rows.

    Reads use one connection per thread (SQLite handles concurrent readers); writes use a
    dedicated connection and must be serialised by the caller (the index's write lock).
    """

    def __init__(self, path: Path, *, read_only: bool = False, create: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only
        if not create and not self.path.is_file():
            raise IndexCorruptError(f"document store {self.path.name} is missing",
                                 "restore the index folder or rebuild it")
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._all_lock = threading.Lock()
        self._w: sqlite3.Connection | None = None
        if not read_only:
            self._w = self._connect(write=True)
            self._w.executescript(_SCHEMA)
            self._w.execute("INSERT OR IGNORE INTO info(key, value) VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            self._w.commit()

    def _connect(self, write: bool = False) -> sqlite3.Connection:
        try:
            if write:
                con = sqlite3.connect(self.path, timeout=30, check_same_thread=False, isolation_level=None)
                con.execute("PRAGMA synchronous=FULL")
            elif os.access(self.path, os.W_OK):
                # A read connection that may write can roll back a hot journal left by a
                # killed writer; a mode=ro one would fail on it.
                con = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
                con.execute("PRAGMA query_only=ON")
            else:
                con = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=30,
                                      check_same_thread=False)
        except sqlite3.Error as e:
            raise IndexCorruptError(f"cannot open document store {self.path.name}: {e}",
                                 "restore the index folder or rebuild it") from None
        with self._all_lock:
            self._all.append(con)
        return con

    def _r(self) -> sqlite3.Connection:
        con = getattr(self._local, "con", None)
        if con is None:
            con = self._connect()
            self._local.con = con
        return con

    def _query(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        try:
            return self._r().execute(sql, tuple(params)).fetchall()
        except sqlite3.DatabaseError as e:
            raise IndexCorruptError(f"document store {self.path.name} cannot be read: {e}",
                                 "restore the index folder or rebuild it") from None

    def close(self) -> None:
        with self._all_lock:
            for con in self._all:
                try:
                    con.close()
                except sqlite3.Error:
                    pass
            self._all.clear()
        self._local = threading.local()
        self._w = None

    # ------------------------------------------------------------------ reads
    def count(self, gen: int) -> int:
        return int(self._query(f"SELECT COUNT(*) FROM docs WHERE {_LIVE}", (gen, gen))[0][0])

    def live_rows(self, gen: int) -> np.ndarray:
        rows = self._query(f"SELECT row FROM docs WHERE {_LIVE} ORDER BY row", (gen, gen))
        return np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))

    def rows_for_ids(self, ids: list[str], gen: int) -> dict[str, int]:
        check_ids(ids)
        out: dict[str, int] = {}
        for part in _chunks(list(ids)):
            q = f"SELECT id, row FROM docs WHERE id IN ({','.join('?' * len(part))}) AND {_LIVE}"
            for doc_id, row in self._query(q, (*part, gen, gen)):
                out[doc_id] = int(row)
        return out

    def fetch(self, rows: Iterable[int], gen: int, with_text: bool = True
              ) -> dict[int, tuple[str, str | None, dict[str, Any]]]:
        """row -> (id, text or None, metadata) for the live rows among ``rows``."""
        out: dict[int, tuple[str, str | None, dict[str, Any]]] = {}
        for part in _chunks([int(r) for r in rows]):
            for row, doc_id, text, meta in self._query(_fetch_sql(len(part), with_text), (*part, gen, gen)):
                out[row] = (doc_id, text, meta_of(meta))
        return out

    def records(self, rows: Iterable[int], gen: int) -> list[tuple[int, str, str, str]]:
        """Raw (row, id, text, meta JSON) of live rows (for the digest)."""
        out: list[tuple[int, str, str, str]] = []
        for part in _chunks([int(r) for r in rows]):
            q = f"SELECT row, id, text, meta FROM docs WHERE row IN ({','.join('?' * len(part))}) AND {_LIVE}"
            out += self._query(q, (*part, gen, gen))
        return out

    def filter_rows(self, flt: dict[str, Scalar], gen: int) -> np.ndarray:
        """Live rows whose metadata matches every field of ``flt``."""
        cond, params = filter_sql(flt)
        rows = self._query(f"SELECT row FROM docs WHERE {_LIVE} AND {cond} ORDER BY row", (gen, gen, *params))
        return np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))

    def digest(self, gen: int) -> str:
        """Recompute the content digest of the rows live at ``gen``."""
        total = 0
        cur = self._r().execute(f"SELECT row, id, text, meta FROM docs WHERE {_LIVE}", (gen, gen))
        try:
            for row, doc_id, text, meta in cur:
                total += record_hash(row, doc_id, text, meta)
        except sqlite3.DatabaseError as e:
            raise IndexCorruptError(f"document store {self.path.name} cannot be read: {e}",
                                 "restore the index folder or rebuild it") from None
        return digest_hex(total)

    # ------------------------------------------------------------------ writes
    def _writer(self) -> sqlite3.Connection:
        if self._w is None:
            raise InvalidInputError("the index was opened read-only", "open it without read_only to change it")
        return self._w

    def apply(self, inserts: list[tuple[int, str, str, str]], delete_rows: list[int], gen: int) -> None:
        """One transaction: retire ``delete_rows`` and insert (row, id, text, meta JSON) at ``gen``."""
        w = self._writer()
        w.execute("BEGIN IMMEDIATE")
        try:
            for part in _chunks(list(delete_rows)):
                w.execute(f"UPDATE docs SET deleted_gen = ? WHERE row IN ({','.join('?' * len(part))}) "
                          "AND deleted_gen IS NULL", (gen, *part))
            w.executemany("INSERT INTO docs(row, id, text, meta, added_gen) VALUES (?, ?, ?, ?, ?)",
                          [(r, i, t, m, gen) for r, i, t, m in inserts])
            w.execute("COMMIT")
        except BaseException:
            w.execute("ROLLBACK")
            raise

    def rollback_after(self, gen: int) -> int:
        """Undo every change of generations above ``gen`` (left by a killed writer)."""
        w = self._writer()
        w.execute("BEGIN IMMEDIATE")
        try:
            n = w.execute("DELETE FROM docs WHERE added_gen > ?", (gen,)).rowcount
            n += w.execute("UPDATE docs SET deleted_gen = NULL WHERE deleted_gen > ?", (gen,)).rowcount
            w.execute("COMMIT")
        except BaseException:
            w.execute("ROLLBACK")
            raise
        return n

    def bulk_insert(self, records: Iterable[tuple[int, str, str, str]], gen: int, batch: int = 10_000) -> None:
        """Insert many records in one transaction (used by builds)."""
        w = self._writer()
        w.execute("BEGIN IMMEDIATE")
        try:
            buf: list[tuple[int, str, str, str, int]] = []
            for r, i, t, m in records:
                buf.append((r, i, t, m, gen))
                if len(buf) >= batch:
                    w.executemany("INSERT INTO docs(row, id, text, meta, added_gen) VALUES (?, ?, ?, ?, ?)", buf)
                    buf.clear()
            if buf:
                w.executemany("INSERT INTO docs(row, id, text, meta, added_gen) VALUES (?, ?, ?, ?, ?)", buf)
            w.execute("COMMIT")
        except BaseException:
            w.execute("ROLLBACK")
            raise

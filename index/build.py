"""Building an index from a corpus: ingest, embed in resumable chunks, index, swap in.

The build works in ``<out>.building/`` next to the target:

1. *ingest*: the corpus is streamed into SQLite (bad lines stop the build or are skipped
   and listed), then documents are numbered by text length so that embedding batches hold
   texts of similar length (less padding) and written to ``docs.sqlite``;
2. *embed*: rows are embedded in chunks of ``chunk_rows``; a chunk grows batch by batch
   (each batch synced) and is renamed when complete, so a build killed at any point resumes
   at the last whole batch;
3. *index*: the chunks become one float16 file, FAISS is trained and filled, the manifest is
   written, and the folder replaces ``<out>`` (the old index stays loadable until then).

``build.json`` records what the staged work belongs to (corpus sha256, embedding space,
options); a rerun with the same inputs resumes, with other inputs it starts over.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from qswap.atomic import atomic_write_json, replace_dir, sha256_file
from qswap.errors import ConflictError, InvalidInputError
from qswap.atomic import atomic_stream, fsync_dir, remove_stale_temps
from qswap.index.config import IndexConfig
from qswap.index.corpus import BadLine, Document, check_documents, corpus_file, iter_corpus
from qswap.index.backends.faiss.docstore import DOCS_FILE, DocStore, meta_json
from qswap.index.checks import normalize_rows
from qswap.index.backends.faiss.embeddings import DTYPE, Chunk, EmbeddingStore, chunk_name
from qswap.index.manifest import MANIFEST, documents_precision, read_manifest
from qswap.index.backends.faiss.index import DocumentIndex
from qswap.index.backends.faiss.generation import write_first_generation
from qswap.index.backends.faiss.recovery import LOCK_FILE, acquire_writer_lock, release_lock
from qswap.space import EmbeddingSpace
from qswap.throughput import Throughput

log = logging.getLogger("qswap.index")

Embed = Callable[[list[str]], np.ndarray]
# An embed callable may count the tokens it embedded in ``tokens_embedded`` (the document
# encoder does): progress then shows tokens/s as well as documents/s.
# (staging, n_docs, embed, full_dim, batch_size, chunk_rows, progress): write every missing chunk
EmbedChunks = Callable[[Path, int, Embed, int, int, int, bool], None]
STATE = "build.json"
INGEST = "ingest.sqlite"
CHUNKS = "chunks"
# Bad lines listed in the manifest (all are counted).
_MAX_BAD_LISTED = 1000


def staging_dir(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    return out_dir.with_name(out_dir.name + ".building")


def build_index(corpus_path: Path, out_dir: Path, embed: Embed, space: EmbeddingSpace,
                config: IndexConfig | None = None, on_bad_line: str = "stop", progress: bool = True, *,
                format: str = "auto", model: str | None = None,
                embed_chunks: "EmbedChunks | None" = None,
                embedding: dict[str, Any] | None = None) -> DocumentIndex:
    """Build (or resume building) the index of a JSONL/BEIR corpus into ``out_dir``.

    ``embed(texts)`` returns full-dimension L2-normalised float32 rows in the space
    ``space`` (the base model with its document prefix). Options left ``None`` in
    ``config`` are chosen by corpus size. An existing index at ``out_dir`` is replaced only
    when the new one is complete. Returns the new index, open for writing.
    ``embed_chunks`` replaces the in-process embedding step (same arguments as
    ``_embed_chunks``; :mod:`qswap.index.ray_build` passes one that runs on a Ray cluster).
    ``embedding``: how ``embed`` embeds (precision, runtime, measured quality), recorded in the
    manifest; a staged build of another precision starts over, so precisions never mix.
    """
    if on_bad_line not in ("stop", "skip"):
        raise InvalidInputError(f"unknown on_bad_line {on_bad_line!r}", "use 'stop' or 'skip'")
    config = config or IndexConfig()
    config.validate(space.dim)
    corpus = corpus_file(corpus_path)
    out_dir = Path(out_dir)
    _check_target(out_dir)
    staging = staging_dir(out_dir)
    staging.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    lock = acquire_writer_lock(staging)
    try:
        corpus_sha = sha256_file(corpus)
        precision = documents_precision({"embedding": embedding} if embedding else {})
        want = {"corpus": str(corpus.resolve()), "corpus_sha256": corpus_sha, "space": space.fingerprint,
                "format": format, "on_bad_line": on_bad_line, "chunk_rows": config.chunk_rows,
                "precision": precision}
        state = _read_state(staging)
        if not _complete_for(staging, corpus_sha, space, precision):
            if state is None or any(state.get(k) != v for k, v in want.items()):
                if state is not None or any(p.name != LOCK_FILE for p in staging.iterdir()):
                    log.warning("%s: discarding an interrupted build of other inputs", staging)
                _wipe(staging)
                state = {**want, "stage": "new", "started_at": t0, "runs": 0}
            state["runs"] = int(state.get("runs", 0)) + 1
            _write_state(staging, state)
            if state["stage"] == "new":
                try:
                    n, bad = _ingest(corpus, staging, format, on_bad_line)
                except InvalidInputError:
                    # Nothing was embedded yet: leave no staging folder behind bad input.
                    shutil.rmtree(staging, ignore_errors=True)
                    raise
                state.update(stage="ingested", n_docs=n, n_bad_lines=len(bad),
                             bad_lines=[b.to_dict() for b in bad[:_MAX_BAD_LISTED]])
                _write_state(staging, state)
            n = int(state["n_docs"])
            cfg = config.resolve(n, space.dim)
            (embed_chunks or _embed_chunks)(staging, n, embed, space.dim, cfg.batch_size,
                                            int(state["chunk_rows"]), progress)
            chunks = [_concat_chunks(staging, n, space.dim, int(state["chunk_rows"]))]
            build = {"corpus": want["corpus"], "corpus_sha256": corpus_sha, "format": format, "model": model,
                     "on_bad_line": on_bad_line, "documents": n, "bad_lines": state["bad_lines"],
                     "n_bad_lines": state["n_bad_lines"], "runs": state["runs"],
                     "batch_size": cfg.batch_size, "chunk_rows": int(state["chunk_rows"]),
                     "started_at": float(state["started_at"])}
            if embedding:
                build["embedding"] = embedding
            write_first_generation(staging, space=space, config=cfg, chunks=chunks, build=build, progress=progress)
        for leftover in (STATE, INGEST):
            (staging / leftover).unlink(missing_ok=True)
        shutil.rmtree(staging / CHUNKS, ignore_errors=True)
    finally:
        release_lock(lock)
    _swap_in(staging, out_dir)
    return DocumentIndex.open(out_dir)


def create_index(out_dir: Path, docs: list[Document], embeddings: np.ndarray, space: EmbeddingSpace,
                 config: IndexConfig | None = None, *, build: dict[str, Any] | None = None,
                 progress: bool = False) -> DocumentIndex:
    """Write a new index from documents and their embeddings (no corpus file, no model)."""
    docs = list(docs)
    check_documents(docs)
    if not docs:
        raise InvalidInputError("no documents to index", "pass at least one document")
    x = normalize_rows(embeddings, space.dim)
    if len(x) != len(docs):
        raise InvalidInputError(f"{len(docs)} documents but {len(x)} embeddings", "pass one embedding per document")
    out_dir = Path(out_dir)
    _check_target(out_dir)
    cfg = (config or IndexConfig()).resolve(len(docs), space.dim)
    staging = staging_dir(out_dir)
    _wipe(staging)
    staging.mkdir(parents=True, exist_ok=True)
    store = DocStore(staging / DOCS_FILE, create=True)
    try:
        store.bulk_insert(((i, d.id, d.text, meta_json(d.metadata)) for i, d in enumerate(docs)), gen=1)
    finally:
        store.close()
    chunk = EmbeddingStore.write_chunk(staging, 0, x.astype(DTYPE), 1)
    write_first_generation(staging, space=space, config=cfg, chunks=[chunk],
                           build={"documents": len(docs), **(build or {})}, progress=progress)
    _swap_in(staging, out_dir)
    return DocumentIndex.open(out_dir)


# ---------------------------------------------------------------------- steps
def _check_target(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or (
            not (out_dir / MANIFEST).exists() and any(p.name != LOCK_FILE for p in out_dir.iterdir()))):
        raise ConflictError(f"{out_dir} exists and is not a qswap index",
                            "choose another output folder, or remove that one")


def _swap_in(staging: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` by the finished ``staging`` unless a writer holds the old index."""
    lock = None
    if out_dir.exists():
        try:
            lock = acquire_writer_lock(out_dir)
        except ConflictError:
            raise ConflictError(f"index {out_dir} is open for writing (e.g. by the server); the new build waits "
                                f"in {staging}", "stop that process and rerun the build to swap it in") from None
    # The old folder goes away with its lock file; release first so nothing holds a stale fd.
    release_lock(lock)
    replace_dir(staging, out_dir)


def _complete_for(staging: Path, corpus_sha: str, space: EmbeddingSpace, precision: str) -> bool:
    """True if an earlier run finished the staged index (it died before the swap)."""
    if not (staging / MANIFEST).is_file():
        return False
    try:
        m = read_manifest(staging)
    except Exception:  # noqa: BLE001 - an unreadable staged manifest just means "not complete"
        return False
    return (m.get("build", {}).get("corpus_sha256") == corpus_sha and m.get("fingerprint") == space.fingerprint
            and documents_precision(m.get("build", {})) == precision)


def _read_state(staging: Path) -> dict[str, Any] | None:
    p = staging / STATE
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def _write_state(staging: Path, state: dict[str, Any]) -> None:
    atomic_write_json(staging / STATE, state)


def _wipe(staging: Path) -> None:
    if not staging.exists():
        return
    for p in staging.iterdir():
        if p.name == LOCK_FILE:
            continue
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def _ingest(corpus: Path, staging: Path, format: str, on_bad_line: str) -> tuple[int, list[BadLine]]:
    """Stream the corpus into SQLite, then write docs.sqlite in length order (row = rank)."""
    for name in (INGEST, DOCS_FILE):
        (staging / name).unlink(missing_ok=True)
        (staging / (name + "-journal")).unlink(missing_ok=True)
    con = sqlite3.connect(staging / INGEST)
    try:
        con.execute("PRAGMA journal_mode=OFF")  # scratch data: a killed ingest starts over anyway
        con.execute("CREATE TABLE corpus (pos INTEGER PRIMARY KEY, id TEXT, text TEXT, meta TEXT, "
                    "etext TEXT, len INTEGER)")
        bad: list[BadLine] = []
        buf: list[tuple[Any, ...]] = []
        pos = 0
        for rec in iter_corpus(corpus, format=format, on_bad_line=on_bad_line, bad_lines=bad):
            d = rec.doc
            buf.append((pos, d.id, d.text, meta_json(d.metadata),
                        rec.embed_text if rec.embed_text != d.text else None, len(rec.embed_text)))
            pos += 1
            if len(buf) >= 10_000:
                con.executemany("INSERT INTO corpus VALUES (?, ?, ?, ?, ?, ?)", buf)
                buf.clear()
        if buf:
            con.executemany("INSERT INTO corpus VALUES (?, ?, ?, ?, ?, ?)", buf)
        if pos == 0:
            skipped = f" ({len(bad)} bad lines skipped)" if bad else ""
            raise InvalidInputError(f"{corpus}: no documents{skipped}",
                                    "give a JSONL file with one {\"id\", \"text\"} object per line")
        if bad:
            log.warning("%s: %d bad lines skipped (listed in the manifest)", corpus, len(bad))
        con.execute("CREATE TABLE sorted AS SELECT row_number() OVER (ORDER BY len, pos) - 1 AS row, pos "
                    "FROM corpus")
        con.execute("CREATE UNIQUE INDEX sorted_row ON sorted(row)")
        con.commit()
        docs = DocStore(staging / DOCS_FILE, create=True)
        try:
            cur = con.execute("SELECT s.row, c.id, c.text, c.meta FROM sorted s JOIN corpus c ON c.pos = s.pos "
                              "ORDER BY s.row")
            docs.bulk_insert(cur, gen=1)
        finally:
            docs.close()
        return pos, bad
    finally:
        con.close()


def _chunk_path(staging: Path, k: int) -> Path:
    return staging / CHUNKS / f"{k:06d}.f16"


def missing_chunks(staging: Path, n: int, full_dim: int, chunk_rows: int,
                   resume_parts: bool) -> tuple[list[tuple[int, int, int, int]], int]:
    """The chunks of ``n`` rows still to embed, for a build that starts or resumes.

    Args:
        staging: the build's staging folder (its chunk folder is created, stale temporaries removed).
        n: rows (documents) of the corpus.
        full_dim: the embedding width.
        chunk_rows: rows per chunk.
        resume_parts: a chunk's ``.part`` file (the local build grows one batch by batch) counts
            its whole rows as done.

    Returns:
        ``([(chunk, first row, end row, rows already in its .part), ...], rows already embedded)``.
    """
    (staging / CHUNKS).mkdir(exist_ok=True)
    remove_stale_temps(staging / CHUNKS)
    row_bytes = full_dim * np.dtype(DTYPE).itemsize
    todo: list[tuple[int, int, int, int]] = []
    done_rows = 0
    for k in range((n + chunk_rows - 1) // chunk_rows):
        a, b = k * chunk_rows, min(n, (k + 1) * chunk_rows)
        p = _chunk_path(staging, k)
        part = p.with_suffix(".part")
        have = 0
        if p.is_file() and p.stat().st_size == (b - a) * row_bytes:
            done_rows += b - a
            continue
        if resume_parts and part.is_file():
            have = min(part.stat().st_size // row_bytes, b - a)  # a torn last row is embedded again
            done_rows += have
        todo.append((k, a, b, have))
    if todo and done_rows:
        log.warning("resuming build: %d of %d documents already embedded", done_rows, n)
    return todo, done_rows


def _embed_chunks(staging: Path, n: int, embed: Embed, full_dim: int, batch_size: int, chunk_rows: int,
                  progress: bool) -> None:
    """Embed every missing chunk; finished chunks (from an earlier run) are kept.

    A chunk in progress grows batch by batch in ``<k>.part`` (each batch flushed and synced),
    so a killed build resumes at the last whole batch, not at the start of its chunk.
    """
    row_bytes = full_dim * np.dtype(DTYPE).itemsize
    todo, done_rows = missing_chunks(staging, n, full_dim, chunk_rows, resume_parts=True)
    if not todo:
        return
    from tqdm import tqdm
    bar = tqdm(total=n, initial=done_rows, unit="doc", desc="embedding", file=sys.stderr, disable=not progress,
               dynamic_ncols=True, smoothing=0.1)
    meter = Throughput()
    con = sqlite3.connect(staging / INGEST)
    try:
        for k, start, b, have in todo:
            a = start + have
            texts = [r[0] for r in con.execute(
                "SELECT COALESCE(c.etext, c.text) FROM sorted s JOIN corpus c ON c.pos = s.pos "
                "WHERE s.row >= ? AND s.row < ? ORDER BY s.row", (a, b))]
            part = _chunk_path(staging, k).with_suffix(".part")
            with open(part, "r+b" if part.exists() else "wb") as f:
                f.truncate(have * row_bytes)
                f.seek(have * row_bytes)
                for i in range(0, len(texts), batch_size):
                    batch = texts[i:i + batch_size]
                    tokens = getattr(embed, "tokens_embedded", 0)
                    e = normalize_rows(embed(batch), full_dim, "embed() output")
                    meter.add(len(batch), getattr(embed, "tokens_embedded", 0) - tokens)
                    if len(e) != len(batch):
                        raise InvalidInputError(f"embed() returned {len(e)} rows for {len(batch)} texts",
                                                "the embed function must return one row per text")
                    f.write(memoryview(np.ascontiguousarray(e.astype(DTYPE))).cast("B"))
                    f.flush()
                    os.fsync(f.fileno())
                    bar.set_postfix_str(meter.rates(), refresh=False)
                    bar.update(len(batch))
            os.replace(part, _chunk_path(staging, k))
            fsync_dir(staging / CHUNKS)
    finally:
        con.close()
        bar.close()
    if progress:
        print(meter.summary("embedded"), file=sys.stderr)


def _concat_chunks(staging: Path, n: int, full_dim: int, chunk_rows: int) -> Chunk:
    """Join the build chunks into the index's first embedding file (rows 0..n-1)."""
    name = chunk_name(0, n, 1)
    n_chunks = (n + chunk_rows - 1) // chunk_rows
    with atomic_stream(staging / name) as w:
        for k in range(n_chunks):
            with open(_chunk_path(staging, k), "rb") as f:
                while block := f.read(1 << 22):
                    w.write(block)
    want = n * full_dim * np.dtype(DTYPE).itemsize
    if w.size != want:
        raise InvalidInputError(f"embedding chunks hold {w.size} bytes, expected {want}",
                                f"delete {staging} and build again")
    return Chunk(name, 0, n, w.sha.hexdigest())

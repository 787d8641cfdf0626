"""The index manifest: the one file that says which other files make up an index.

It is written last (atomically) by every commit; whatever it does not list is a leftover
of an interrupted write. It records the embedding-space fingerprint, the options, the
counts, the sha256 of every immutable file, the document-store digest, build facts and
the qswap version.

Layout of an index folder::

    manifest.json              this record
    docs.sqlite                documents (id, text, metadata JSON), generation-tagged
    emb/<start>-<end>.g<G>.f16 full-precision float16 embedding chunks (row = FAISS id)
    faiss/index.g<G>.faiss     FAISS snapshot (rows added or removed since are replayed on load)
    .lock                      writer lock (flock)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from qswap.atomic import atomic_write_json, sha256_file
from qswap.index.errors import IndexCorruptError
from qswap.errors import ConflictError, InvalidInputError, NotFoundError

MANIFEST = "manifest.json"
FORMAT = "qswap-index"
FORMAT_VERSION = 1
FAISS_DIR = "faiss"
_REQUIRED = ("format", "format_version", "generation", "space", "metric", "config", "full_dim", "dim",
             "embeddings", "faiss", "docstore", "counts", "files")


def faiss_name(generation: int) -> str:
    return f"{FAISS_DIR}/index.g{generation:08d}.faiss"


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_manifest(root: Path) -> dict[str, Any]:
    """Parse and sanity-check ``root/manifest.json``."""
    root = Path(root)
    p = root / MANIFEST
    if not p.is_file():
        building = root.with_name(root.name + ".building")
        hint = ("a build into it was interrupted: rerun the same `qswap index build` to resume"
                if building.exists() else "build one with `qswap index build`")
        raise NotFoundError(f"{root} is not a qswap index (no {MANIFEST})", hint)
    try:
        m = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IndexCorruptError(f"{p} is not valid JSON ({e})", "restore the index folder or rebuild it") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise IndexCorruptError(f"{p} is not a qswap index manifest", "point at an index folder built by qswap")
    missing = [k for k in _REQUIRED if k not in m]
    if missing:
        raise IndexCorruptError(f"{p} lacks {', '.join(missing)}", "restore the index folder or rebuild it")
    if int(m["format_version"]) > FORMAT_VERSION:
        raise InvalidInputError(
            f"index format version {m['format_version']} is newer than this qswap reads ({FORMAT_VERSION})",
            "upgrade qswap")
    if m["metric"] != "inner_product":
        raise IndexCorruptError(f"unsupported metric {m['metric']!r} in {p}", "rebuild the index with qswap")
    return m


def documents_precision(build: dict[str, Any]) -> str:
    """Precision the index's documents were embedded at (its ``build.embedding`` record);
    ``fp32`` for indexes built before precisions were recorded (they were all fp32)."""
    emb = build.get("embedding") or {}
    return str(emb.get("precision") or "fp32")


def require_precision(build: dict[str, Any], precision: str, where: str = "the index") -> None:
    """Raise :class:`ConflictError` if documents at ``precision`` would mix with ``where``'s.

    Args:
        build: the index's build facts (``manifest["build"]`` / ``info()["build"]``).
        precision: the precision new documents would be embedded at.
        where: what the index is called in the message.
    """
    have = documents_precision(build)
    if have != precision:
        raise ConflictError(f"{where} holds documents embedded at {have}; new ones would be {precision}",
                            f"embed them at {have} (leave --precision out), or rebuild the index at {precision}")


def write_manifest(root: Path, m: dict[str, Any]) -> None:
    """Commit point of every change: atomic, fsynced, written after every file it lists."""
    atomic_write_json(Path(root) / MANIFEST, m)


def verify_files(root: Path, files: dict[str, str]) -> None:
    """Check that every listed file exists and has its recorded sha256."""
    for name, want in sorted(files.items()):
        p = Path(root) / name
        if not p.is_file():
            raise IndexCorruptError(f"index file {name} is missing", "restore the index folder or rebuild it")
        got = sha256_file(p)
        if got != want:
            raise IndexCorruptError(f"index file {name}: sha256 {got[:12]}... differs from the manifest's {want[:12]}...",
                                 "the file was modified or damaged; restore it or rebuild the index")

"""Opening safely: the writer lock (naming its holder) and recovery after a killed writer.

A commit that died before its manifest rename leaves SQLite rows of a later generation and
files no manifest lists; the next writer rolls the rows back (``DocStore.rollback_after``)
and removes the files (:func:`remove_orphans`). A FAISS snapshot older than the manifest is
brought up to the live rows by :func:`reconcile`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import faiss
import numpy as np

import qswap.index.backends.faiss.faiss_index as faiss_index
from qswap.atomic import remove_stale_temps
from qswap.errors import ConflictError
from qswap.index.backends.faiss.embeddings import EMB_DIR, EmbeddingStore
from qswap.index.manifest import FAISS_DIR, MANIFEST
from qswap.locks import try_lock

LOCK_FILE = ".lock"


def lock_holder(path: Path) -> str:
    """Who holds the writer lock of ``path`` as recorded in its lock file ("process 123" or "unknown")."""
    try:
        pid = (path / LOCK_FILE).read_text().split()[0]
        return f"process {int(pid)}"
    except (OSError, IndexError, ValueError):
        return "another process or handle"


def acquire_writer_lock(path: Path) -> int:
    """Take the folder's writer lock (flock, released by the kernel if the process dies).

    The holder writes its pid into the lock file so that a refused writer can name it."""
    lock_file = path / LOCK_FILE
    try:
        fd = try_lock(lock_file, "", "")
    except ConflictError:
        raise ConflictError(f"index {path} is open for writing by {lock_holder(path)}",
                            "stop that process (e.g. the server) or open this index read-only") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release_lock(fd: int | None) -> None:
    """Release a writer lock (closing the descriptor drops the flock)."""
    if fd is not None:
        os.close(fd)


def reconcile(index: faiss.Index, live: np.ndarray, store: EmbeddingStore, dim: int) -> np.ndarray:
    """Bring a FAISS snapshot up to the live rows; returns tombstones (rows it cannot remove)."""
    have = np.unique(faiss_index.ids_of(index))
    to_add = np.setdiff1d(live, have, assume_unique=True)
    extra = np.setdiff1d(have, live, assume_unique=True)
    for r, x in store.iter_rows(to_add):
        faiss_index.add(index, r, x, dim)
    if len(extra):
        if faiss_index.can_remove(index):
            faiss_index.remove(index, extra)
            return np.zeros(0, np.int64)
        return extra
    return np.zeros(0, np.int64)


def peek_generation(path: Path) -> int | None:
    try:
        return int(json.loads((path / MANIFEST).read_text())["generation"])
    except Exception:  # noqa: BLE001 - any unreadable manifest just means "unknown"
        return None


def remove_orphans(path: Path, m: dict[str, Any]) -> None:
    """Delete files an interrupted commit wrote but no manifest lists."""
    listed = set(m["files"])
    for sub in (EMB_DIR, FAISS_DIR):
        folder = path / sub
        remove_stale_temps(folder)
        if folder.is_dir():
            for p in folder.iterdir():
                if p.is_file() and f"{sub}/{p.name}" not in listed:
                    p.unlink(missing_ok=True)
    remove_stale_temps(path)

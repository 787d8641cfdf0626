"""Streaming atomic writes that also hash what they write.

:mod:`qswap.atomic` writes whole byte strings; index files (embedding chunks, FAISS indexes)
can be large or are written by a library to a path, so these helpers stream to a temporary
file, fsync it, rename it into place, fsync the folder, and return the sha256.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from qswap.atomic import fsync_dir, sha256_file


class HashingWriter:
    """File wrapper that feeds every written block to a sha256."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        self._fh.write(data)
        self.sha.update(data)
        self.size += len(data)


def _tmp_in(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    # mkstemp makes 0600 files; index files are data for other users (e.g. a server) too.
    os.fchmod(fd, 0o644)
    os.close(fd)
    return tmp


@contextmanager
def atomic_stream(path: Path) -> Iterator[HashingWriter]:
    """Write ``path`` through a :class:`HashingWriter`; it appears only when the block exits cleanly."""
    path = Path(path)
    tmp = _tmp_in(path)
    try:
        with open(tmp, "wb") as fh:
            w = HashingWriter(fh)
            yield w
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_via(path: Path, write: Callable[[str], None]) -> str:
    """Let ``write(tmp_path)`` produce the file, then fsync and rename it; returns its sha256."""
    path = Path(path)
    tmp = _tmp_in(path)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        sha = sha256_file(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return sha


def remove_stale_temps(folder: Path) -> None:
    """Delete temporary files left by a write that was killed (``.<name>.<random>.tmp``)."""
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if p.is_file() and p.name.startswith(".") and p.name.endswith(".tmp"):
            p.unlink(missing_ok=True)

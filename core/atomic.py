"""Crash-safe file writes: temporary file, fsync, rename, fsync of the directory.

A process killed at any instant leaves either the old file or the new one, never a torn
one. Directory-level commits write every file first and a manifest last; readers trust
only what the manifest lists (with sha256), so a half-written set is never loaded.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sqlite3
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))
_SQLITE_FULL = 13


def disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an error it was raised from) says the disk or quota is full.

    Writes fail in three dialects: ``OSError`` with ENOSPC/EDQUOT (Python file I/O), SQLite's
    SQLITE_FULL, and libraries that turn ``errno`` into text (FAISS: "write error ... No space
    left on device").

    Args:
        exc: the exception to inspect (its ``__cause__`` / ``__context__`` chain included).

    Returns:
        True when a full disk or quota caused it.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return True
        if isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) == _SQLITE_FULL:
            return True
        if isinstance(exc, RuntimeError) and any(t in str(exc) for t in _FULL_TEXTS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    # mkstemp makes 0600 files; indexes and encoders are data for other users (a server) too.
    os.fchmod(fd, 0o644)
    os.close(fd)
    return tmp


@contextmanager
def _temp_then_rename(path: Path) -> Iterator[str]:
    """A temporary file beside ``path`` for the block to write and fsync; renamed onto ``path``
    when the block exits cleanly, deleted when it raises."""
    tmp = _tmp_in(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


@contextmanager
def atomic_stream(path: Path) -> Iterator[HashingWriter]:
    """Write ``path`` through a :class:`HashingWriter`; it appears only when the block exits cleanly."""
    path = Path(path)
    with _temp_then_rename(path) as tmp, open(tmp, "wb") as fh:
        w = HashingWriter(fh)
        yield w
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_via(path: Path, write: Callable[[str], None]) -> str:
    """Let ``write(tmp_path)`` produce the file (e.g. a library that writes to a path), then
    fsync and rename it into place; returns its sha256."""
    path = Path(path)
    with _temp_then_rename(path) as tmp:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        sha = sha256_file(Path(tmp))
    return sha


def remove_stale_temps(folder: Path) -> None:
    """Delete temporary files left by a write that was killed (``.<name>.<random>.tmp``)."""
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if p.is_file() and p.name.startswith(".") and p.name.endswith(".tmp"):
            p.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new content, never a mix."""
    with atomic_stream(path) as w:
        w.write(data)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as indented, key-sorted JSON."""
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _open_append(path: Path) -> int:
    """The file descriptor :func:`append_line` writes through (created 0644 if missing)."""
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def committed_end(fd: int, size: int) -> int:
    """Offset just past the last newline of the first ``size`` bytes of ``fd`` (0: none).

    What follows it is the torn tail of an append that failed or was killed: not committed.
    """
    pos = size
    while pos > 0:
        start = max(0, pos - (1 << 16))
        block = os.pread(fd, pos - start, start)
        nl = block.rfind(b"\n")
        if nl >= 0:
            return start + nl + 1
        pos = start
    return 0


def append_line(path: Path, line: bytes) -> tuple[int, int]:
    """Durably append one newline-terminated record to ``path`` (a journal).

    A record is committed once its newline is on disk. The record is written at the end of the
    last committed one, so the torn tail of an earlier failed or killed append is overwritten;
    when this append fails, the file is cut back to where it was (a refused change leaves
    nothing readable), and the error is raised.

    Args:
        path: the journal file (created when missing).
        line: the record, ending with ``b"\\n"`` and holding no other newline.

    Returns:
        (start, end): the byte offsets of the record in the file.
    """
    if not line.endswith(b"\n") or b"\n" in line[:-1]:
        raise ValueError("a journal record is one line ending with a newline")
    path = Path(path)
    created = not path.exists()
    fd = _open_append(path)
    try:
        start = committed_end(fd, os.fstat(fd).st_size)
        end = start + len(line)
        try:
            view = memoryview(line)
            while view:
                n = os.pwrite(fd, view, end - len(view))
                view = view[n:]
            if os.fstat(fd).st_size > end:
                os.ftruncate(fd, end)
            os.fsync(fd)
        except BaseException:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass   # best effort: the next append overwrites from the last record committed before
            raise
    finally:
        os.close(fd)
    if created:
        fsync_dir(path.parent)
    return start, end


def atomic_copy(src: Path, dst: Path) -> str:
    """Copy a file to ``dst`` atomically; returns its sha256."""
    return atomic_write_via(Path(dst), lambda tmp: shutil.copyfile(src, tmp))


def replace_dir(staging: Path, target: Path) -> None:
    """Swap a fully written ``staging`` directory into ``target``.

    POSIX has no atomic swap of non-empty directories, so the old target is first renamed
    aside, then ``staging`` renamed in, then the old copy removed. A crash between the two
    renames leaves ``target.old``; :func:`recover_dir` puts it back.
    """
    staging, target = Path(staging), Path(target)
    old = target.with_name(target.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old)


@contextmanager
def staged_dir(target: Path, prefix: str | None = None) -> Iterator[Path]:
    """A fresh staging directory beside ``target``: filled by the block, swapped in when it exits cleanly.

    The one way qswap writes a whole directory (an encoder, an export, a sentinel set, a data
    set): readers see the old directory or the complete new one (:func:`replace_dir`), and a
    block that raises leaves ``target`` as it was and no staging directory behind.

    Args:
        target: the directory to create or replace; its parent is created if needed.
        prefix: the staging directory's name prefix (default ``.<target name>.``), so that a
            caller can find and remove the leftovers of a killed writer.

    Yields:
        The staging directory (mode 0755: the data is for other users, such as a server, too).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=prefix or f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)   # mkdtemp makes 0700
    try:
        yield staging
        fsync_dir(staging)
        replace_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def recover_dir(target: Path) -> None:
    """Undo a :func:`replace_dir` interrupted between its renames."""
    target = Path(target)
    old = target.with_name(target.name + ".old")
    if not target.exists() and old.exists():
        os.replace(old, target)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_sha_memo: dict[tuple[str, int, int, int, int], str] = {}
_sha_stored: set[tuple[tuple[str, int, int, int, int], str]] = set()   # (key, store) with a record


def sha256_file_cached(path: Path, store: Path | None = None) -> str:
    """:func:`sha256_file`, remembered per file identity: resolved path, size, inode, mtime and
    ctime (nanoseconds). A changed file is hashed again.

    Model weights are hundreds of MB and are fingerprinted at every load (a server start): the
    hash is kept for this process, and with ``store`` also in a small JSON record per file
    there, so that the next process skips reading the file. Safe enough because any write to
    the file changes its mtime and ctime, and ctime cannot be set back (``touch``, ``cp -p`` and
    ``rsync -t`` restore mtime only); only a same-size rewrite within one tick of a coarse
    filesystem clock would be missed.
    """
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
    # Known in this process, and (with a store) already in that store's record: nothing to read.
    if key in _sha_memo and (store is None or (key, str(store)) in _sha_stored):
        return _sha_memo[key]
    if store is None:
        _sha_memo[key] = sha256_file(p)
        return _sha_memo[key]
    record = Path(store) / f"{hashlib.sha256(str(p).encode()).hexdigest()}.json"
    try:
        d = json.loads(record.read_text())
        if tuple(d["key"]) == key and isinstance(d["sha256"], str):
            _sha_memo[key] = d["sha256"]
            _sha_stored.add((key, str(store)))
            return d["sha256"]
    except (OSError, ValueError, KeyError, TypeError):   # none yet, or torn: hash the file
        pass
    digest = _sha_memo.get(key) or sha256_file(p)
    _sha_memo[key] = digest
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(record, {"key": list(key), "sha256": digest})
        _sha_stored.add((key, str(store)))
    except OSError:   # a read-only or full disk: the next process hashes the file again
        pass
    return digest

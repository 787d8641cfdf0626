"""Crash-safe file writes: temporary file, fsync, rename, fsync of the directory.

A process killed at any instant leaves either the old file or the new one, never a torn
one. Directory-level commits write every file first and a manifest last; readers trust
only what the manifest lists (with sha256), so a half-written set is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new content, never a mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as indented, key-sorted JSON."""
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def atomic_copy(src: Path, dst: Path) -> None:
    """Copy a file to ``dst`` atomically (temporary copy, fsync, rename)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(dst.parent)


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

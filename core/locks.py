"""Directory locks between processes (flock: the kernel releases them when a process dies)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qswap.errors import ConflictError


def try_lock(lock_file: Path, message: str, hint: str, *, shared: bool = False) -> int:
    """Take an exclusive (or, with ``shared``, a shared) non-blocking lock on ``lock_file``
    (created if missing).

    Returns the file descriptor that holds the lock (close it to release); raises
    :class:`ConflictError` with ``message`` / ``hint`` when another process holds it (any
    lock, for an exclusive one; an exclusive one, for a shared one).
    """
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConflictError(message, hint) from None
    return fd


@contextmanager
def exclusive_lock(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (created if missing), waiting for it if need be:
    for one-off work that two processes must not do at once (e.g. converting a model)."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # closing releases the lock

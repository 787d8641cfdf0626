"""The capture store's size bound: the database file, its WAL and its shared-memory file together
stay under ``max_bytes`` at every moment, not only after a periodic prune.

How, with SQLite's own mechanisms rather than by measuring after the fact:

- the WAL gets a share of the bound (``max_bytes / 8``, at least 64 pages); each transaction is
  kept small enough to fit half of it, and after a commit that leaves the WAL above half its
  share the WAL is checkpointed and truncated;
- the database file gets the rest, enforced by ``PRAGMA max_page_count``: SQLite refuses a
  write that would grow the file past it ("database or disk is full") instead of growing;
- before a write, room is made: when the free pages would not hold it, the oldest impressions
  are deleted (in transactions as small as the writes) until they do; a write refused anyway
  prunes more and is tried again. Deleted rows' pages are reused by later writes, so the file
  does not shrink and need not be vacuumed (a vacuum would need a second copy on disk).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Callable

#: Extra files SQLite keeps beside the database in WAL mode.
SIDE_FILES = ("-wal", "-shm")
SHM_BYTES_PER = 32 * 1024, 4096   # the WAL's shared-memory index: 32 KiB per 4,096 WAL pages


class SizeBound:
    """The bound of one SQLite file in WAL mode (see the module docstring).

    Args:
        path: the database file.
        max_bytes: database + WAL + shared memory at most.
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.page_size = 4096
        self.wal_budget = 0
        self.max_pages = 0

    def configure(self, db: sqlite3.Connection) -> None:
        """Set the page limit on ``db`` (every connection needs it)."""
        self.page_size = db.execute("PRAGMA page_size").fetchone()[0]
        self.wal_budget = max(64 * self.page_size, self.max_bytes // 8)
        shm = SHM_BYTES_PER[0] * (self.wal_budget // self.page_size // SHM_BYTES_PER[1] + 1)
        self.max_pages = max(16, (self.max_bytes - self.wal_budget - shm) // self.page_size)
        db.execute("PRAGMA wal_autocheckpoint = 0")   # checkpoints are ours: after_commit
        db.execute(f"PRAGMA max_page_count = {self.max_pages}")

    def too_big(self, db: sqlite3.Connection) -> bool:
        """Whether the file holds more pages than the bound allows (a store opened with a
        smaller bound than it was written with)."""
        return db.execute("PRAGMA page_count").fetchone()[0] > self.max_pages

    @property
    def tx_bytes(self) -> int:
        """The most one transaction should write: half the WAL's share."""
        return self.wal_budget // 2

    def pages_for(self, nbytes: int) -> int:
        """Pages a write of ``nbytes`` of row data may take: twice its size (indexes, slack)
        plus one split in each b-tree."""
        return 2 * nbytes // self.page_size + 6

    def free_pages(self, db: sqlite3.Connection) -> int:
        """Pages a write may still take: free pages inside the file plus what it may grow."""
        count = db.execute("PRAGMA page_count").fetchone()[0]
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
        return free + max(0, self.max_pages - count)

    def make_room(self, db: sqlite3.Connection, nbytes: int, drop_oldest: Callable[[int], int]) -> None:
        """Prune before a write of ``nbytes``: delete the oldest rows (``drop_oldest(n)`` deletes
        up to ``n`` in one small transaction and returns how many) until the write fits."""
        need = self.pages_for(nbytes)
        chunk = max(1, self.tx_bytes // (6 * self.page_size))
        while self.free_pages(db) < need:
            if drop_oldest(chunk) == 0:
                return   # nothing left to drop: the write may still fit, else SQLite refuses it
            self.after_commit(db)
            chunk *= 2

    def after_commit(self, db: sqlite3.Connection) -> None:
        """Checkpoint and truncate the WAL once it holds half its share."""
        if self.wal_bytes() > self.wal_budget // 2:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def wal_bytes(self) -> int:
        p = self.path.with_name(self.path.name + "-wal")
        try:
            return p.stat().st_size
        except FileNotFoundError:
            return 0

    def size(self) -> int:
        """The database, its WAL and its shared memory, in bytes."""
        total = 0
        for suffix in ("", *SIDE_FILES):
            try:
                total += self.path.with_name(self.path.name + suffix).stat().st_size
            except FileNotFoundError:
                pass
        return total


def is_full(e: sqlite3.Error) -> bool:
    """Whether SQLite refused a write for want of room (the page limit or the disk)."""
    return isinstance(e, sqlite3.OperationalError) and "full" in str(e)


__all__ = ["SizeBound", "is_full"]

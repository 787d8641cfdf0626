"""The registry's records: what the server keeps about each encoder, and the table's files.

The table is a snapshot plus a journal, so a change writes what changed, not the whole table:

- ``registry.json`` (the snapshot): every :class:`EncoderRecord` and alias as of change
  ``seq``, replaced atomically (temporary file, fsync, rename);
- ``registry.journal``: one JSON line per change after the snapshot (the records put or
  dropped, the aliases set or removed), appended and fsynced by :func:`qswap.atomic.append_line`.

A change is committed once its line is on disk; :meth:`RecordTable.commit` appends it, then
swaps the new tables into memory under the lock, so readers (the event loop) see the old
tables or the new ones, and a crash loses nothing acknowledged (a torn last line is ignored
and overwritten). When the journal outgrows the snapshot (and at a clean shutdown) the two are
folded into a new snapshot: snapshot first, then an empty journal; journal lines at or below
the snapshot's ``seq`` are skipped, so a crash between the two steps loses nothing either.
Readers that share the state dir (Ray replicas) read the journal from where they stopped.
A ``registry.json`` from before the journal is a snapshot at ``seq`` 0: nothing to migrate.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from qswap.atomic import append_line, atomic_write_bytes
from qswap.encoders.artifact import EncoderManifest
from qswap.errors import IntegrityError
from qswap.guard import GuardRecord, GuardStatus
from qswap.locks import try_lock

log = logging.getLogger("qswap.server")

REGISTRY_FILE = "registry.json"
JOURNAL_FILE = "registry.journal"
STATE_LOCK_FILE = ".lock"
FORMAT = 1
COMPACT_MIN_BYTES = 1 << 20   # the journal is folded when larger than this and than the snapshot


def split_key(key: str) -> tuple[str, str]:
    """``name@version`` -> (name, version); names cannot contain '@'."""
    name, _, version = key.partition("@")
    return name, version


def version_order(version: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key of a version: natural order, runs of digits compare as numbers ("10" > "9",
    "1.10" > "1.9", "v10" > "v2"), the rest as text; a number sorts after text at one place."""
    return tuple((1, int(part), "") if part.isdigit() else (0, 0, part)
                 for part in re.split(r"(\d+)", version) if part)


@dataclass
class EncoderRecord:
    """What the registry file keeps about one registered encoder."""

    key: str
    name: str
    version: str
    kind: str
    space: str
    files: dict[str, str]
    registered_at: float
    source: str
    created_at: float | None = None
    training: dict[str, Any] | None = None
    guard: GuardRecord | None = None             # the manifest's own record (informational)
    guard_status: GuardStatus = GuardStatus.UNGUARDED
    forced: bool = False                         # force given: servable once its verdict is known
    evaluation: GuardRecord | None = None        # the server's own guard record (per-sentinel table)

    def __post_init__(self) -> None:
        # Read back from JSON: a plain string and plain objects.
        self.guard_status = GuardStatus(self.guard_status)
        if isinstance(self.evaluation, dict):
            self.evaluation = GuardRecord.of(self.evaluation)
        if isinstance(self.guard, dict):
            self.guard = _self_reported(self.guard)

    def to_json(self) -> dict[str, Any]:
        """The record as the registry files hold it (plain JSON objects)."""
        return {**asdict(replace(self, guard=None, evaluation=None)),
                "guard": self.guard.to_json() if self.guard is not None else None,
                "evaluation": self.evaluation.to_json() if self.evaluation is not None else None}

    @property
    def digest(self) -> str:
        """What a verdict is about: the kind and the sha256 of every file (a re-registration of
        the same key with other files has another digest)."""
        blob = json.dumps([self.kind, sorted(self.files.items())]).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def servable(self) -> bool:
        """May serve (by name, as the default, behind a new alias): its verdict passed (or there
        is no guard), or force was given and its verdict is known. Never while evaluating."""
        return self.guard_status.servable or (self.forced and self.guard_status != GuardStatus.EVALUATING)

    @classmethod
    def from_manifest(cls, m: EncoderManifest, source: str) -> "EncoderRecord":
        """A new record for the encoder ``m`` describes, registered now from ``source``."""
        return cls(key=m.key, name=m.name, version=m.version, kind=m.kind,
                   space=str(m.space.get("fingerprint") or m.embedding_space().fingerprint),
                   files=dict(m.files), registered_at=time.time(), source=source,
                   created_at=m.created_at, training=m.training, guard=m.guard)


def _self_reported(guard: dict[str, Any]) -> GuardRecord | None:
    """A manifest's own guard record; None when malformed (only a forced registration keeps such
    a manifest, and the record decides nothing there)."""
    try:
        return GuardRecord.of(guard)
    except ValidationError:
        return None


Records = dict[str, EncoderRecord]
Aliases = dict[str, str]


@dataclass(frozen=True)
class TablePosition:
    """How far a reader has read the table files: which snapshot and journal (inode numbers),
    the journal offset after the last line read, and the last change applied."""

    snapshot: int | None
    journal: int | None
    offset: int
    seq: int


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _record(key: str, data: Any, where: str) -> EncoderRecord:
    if not isinstance(data, dict):
        raise TypeError(f"{where}: the record of {key} is not an object")
    return EncoderRecord(**data)


class RecordTable:
    """The records and aliases of one state dir, in memory and in the table files.

    ``records`` and ``aliases`` are replaced, never changed in place: a reader that took them
    under ``lock`` holds a consistent view. ``by_name`` (name -> keys) and ``sorted_keys`` are
    derived at each swap, so resolving a name or paging the list never scans every record.
    Changes go through :meth:`commit` (the caller serialises changes with its admin lock).
    """

    def __init__(self, state_dir: Path, lock: threading.RLock) -> None:
        self.state_dir = Path(state_dir)
        self.file = self.state_dir / REGISTRY_FILE
        self.journal = self.state_dir / JOURNAL_FILE
        self.lock = lock
        self.records: Records = {}
        self.aliases: Aliases = {}
        self.by_name: dict[str, tuple[str, ...]] = {}
        self.sorted_keys: list[str] = []
        self.position = TablePosition(None, None, 0, 0)
        self._snapshot_bytes = 0
        self._io_lock = threading.Lock()   # file reads and writes, with the position and swap they imply
        self._state_fd: int | None = None
        self._exclusive = False

    def swap(self, records: Records, aliases: Aliases) -> None:
        """Make ``records`` and ``aliases`` the tables in memory (caller holds ``lock``)."""
        if records is not self.records:
            by_name: dict[str, list[str]] = {}
            for k, r in records.items():
                by_name.setdefault(r.name, []).append(k)
            self.by_name = {n: tuple(ks) for n, ks in by_name.items()}
            self.sorted_keys = sorted(records)
        self.records, self.aliases = records, aliases

    # -- reading ---------------------------------------------------------------------------------

    def _invalid(self, path: Path, e: Exception) -> IntegrityError:
        return IntegrityError(f"{path.name} in the state dir is not a valid registry file: {e}",
                              "restore it from a backup, or move it away to start with no encoders")

    def read(self) -> tuple[Records, Aliases]:
        """Parse the snapshot and replay the journal (empty when there is neither).

        Returns:
            (records, aliases) as stored.
        """
        with self._io_lock:
            records, aliases, seq, snap = self._read_snapshot()
            records, aliases, pos = self._replay(records, aliases, TablePosition(snap, _inode(self.journal), 0, seq))
            self.position = pos
        return records, aliases

    def _read_snapshot(self) -> tuple[Records, Aliases, int, int | None]:
        try:
            raw = self.file.read_bytes()
            st = os.stat(self.file)
        except FileNotFoundError:
            self._snapshot_bytes = 0
            return {}, {}, 0, None
        try:
            data = json.loads(raw)
            records = {k: _record(k, v, self.file.name) for k, v in data.get("encoders", {}).items()}
            aliases = {str(k): str(v) for k, v in data.get("aliases", {}).items()}
            seq = int(data.get("seq", 0))
        except (json.JSONDecodeError, TypeError, ValueError, AttributeError, UnicodeDecodeError) as e:
            raise self._invalid(self.file, e) from None
        self._snapshot_bytes = len(raw)
        return records, aliases, seq, st.st_ino

    def _replay(self, records: Records, aliases: Aliases,
                pos: TablePosition) -> tuple[Records, Aliases, TablePosition]:
        """Apply the journal's complete lines after ``pos`` (new dicts only when one applies)."""
        try:
            with open(self.journal, "rb") as f:
                if os.fstat(f.fileno()).st_ino != pos.journal:   # replaced since it was stat'ed
                    pos = replace(pos, journal=os.fstat(f.fileno()).st_ino, offset=0)
                f.seek(pos.offset)
                data = f.read()
        except FileNotFoundError:
            return records, aliases, pos
        end = data.rfind(b"\n") + 1   # past it: an append in progress, or a torn one
        if end == 0:
            return records, aliases, pos
        seq = pos.seq
        copied = False
        for n, line in enumerate(data[:end].splitlines()):
            try:
                change = json.loads(line)
                if int(change["seq"]) <= seq:
                    continue   # already in the snapshot (a crash between its write and the journal's reset)
                if not copied:
                    records, aliases, copied = dict(records), dict(aliases), True
                for k, v in change.get("put", {}).items():
                    records[k] = _record(k, v, self.journal.name)
                for k in change.get("drop", []):
                    records.pop(k, None)
                aliases.update({str(d): str(k) for d, k in change.get("alias", {}).items()})
                for d in change.get("unalias", []):
                    aliases.pop(d, None)
                seq = int(change["seq"])
            except (json.JSONDecodeError, TypeError, ValueError, KeyError, AttributeError, UnicodeDecodeError) as e:
                raise self._invalid(self.journal, f"line {n + 1} after offset {pos.offset}: {e}") from None
        return records, aliases, replace(pos, offset=pos.offset + end, seq=seq)

    def read_changes(self) -> bool:
        """Apply the changes another process committed since the last read, and swap them in
        (only the new journal lines are read; the whole table when it was folded meanwhile).

        Returns:
            True when something changed.
        """
        with self._io_lock:
            snap, journal = _inode(self.file), _inode(self.journal)
            pos = self.position
            if snap != pos.snapshot or journal != pos.journal:
                records, aliases, seq, snap = self._read_snapshot()
                start = TablePosition(snap, journal, 0, seq)
            else:
                try:
                    size = os.stat(self.journal).st_size
                except FileNotFoundError:
                    size = 0
                if size <= pos.offset:
                    return False
                with self.lock:
                    records, aliases = self.records, self.aliases
                start = pos
            records, aliases, new = self._replay(records, aliases, start)
            if new == pos:
                return False
            self.position = new
            with self.lock:
                self.swap(records, aliases)
        return True

    # -- writing ---------------------------------------------------------------------------------

    def commit(self, records: Records | None = None, aliases: Aliases | None = None) -> None:
        """Append the change from the current tables to ``records`` and/or ``aliases`` to the
        journal, then swap them in (a failed append changes nothing and raises).

        Args:
            records: the new records (None: unchanged). Records are compared by identity: a
                changed record is a new object (records are never changed in place).
            aliases: the new aliases (None: unchanged).
        """
        with self._io_lock:
            with self.lock:
                old_records, old_aliases = self.records, self.aliases
            new_records = old_records if records is None else records
            new_aliases = old_aliases if aliases is None else aliases
            change: dict[str, Any] = {
                "put": {k: r.to_json() for k, r in new_records.items() if old_records.get(k) is not r},
                "drop": [k for k in old_records if k not in new_records],
                "alias": {d: k for d, k in new_aliases.items() if old_aliases.get(d) != k},
                "unalias": [d for d in old_aliases if d not in new_aliases]}
            change = {k: v for k, v in change.items() if v}
            if change:
                seq = self.position.seq + 1
                line = json.dumps({"seq": seq, **change}, sort_keys=True, separators=(",", ":")) + "\n"
                _, end = append_line(self.journal, line.encode())
                self.position = replace(self.position, journal=_inode(self.journal), offset=end, seq=seq)
            with self.lock:
                self.swap(new_records, new_aliases)
            fold = bool(change) and self.position.offset > max(COMPACT_MIN_BYTES, self._snapshot_bytes)
        if fold:
            self.compact()

    def update(self, key: str, **changes: Any) -> EncoderRecord:
        """Replace fields of one record (file first); returns the new record."""
        with self.lock:
            rec = replace(self.records[key], **changes)
            records = {**self.records, key: rec}
        self.commit(records=records)
        return rec

    def without(self, key: str) -> Records:
        """The records less ``key`` (for :meth:`commit`)."""
        with self.lock:
            return {k: r for k, r in self.records.items() if k != key}

    def compact(self) -> None:
        """Fold the journal into a new snapshot (the caller serialises changes). A failure (a
        full disk) leaves the committed snapshot and journal as they were, and is logged."""
        with self._io_lock:
            if self.position.offset == 0 and self.file.exists():
                return
            with self.lock:
                records, aliases = self.records, self.aliases
            seq = self.position.seq
            try:
                blob = (json.dumps({"format": FORMAT, "seq": seq,
                                    "encoders": {k: r.to_json() for k, r in sorted(records.items())},
                                    "aliases": dict(sorted(aliases.items()))}, indent=2, sort_keys=True)
                        + "\n").encode()
                atomic_write_bytes(self.file, blob)
                atomic_write_bytes(self.journal, b"")
            except OSError:
                log.warning("registry snapshot not written (the journal keeps every change)", exc_info=True)
                return
            self._snapshot_bytes = len(blob)
            self.position = TablePosition(_inode(self.file), _inode(self.journal), 0, seq)

    # -- the state-dir lock ---------------------------------------------------------------------

    def lock_dir(self, take: Callable[[Path], int] | None = None) -> None:
        """Hold the state dir's lock file (exclusive unless ``take`` opens it otherwise)."""
        if self._state_fd is not None:
            return
        self._exclusive = take is None
        path = self.state_dir / STATE_LOCK_FILE
        # Two servers writing one registry file would lose each other's changes.
        self._state_fd = take(path) if take is not None else try_lock(
            path, "the state dir is in use by another server", "give each server its own --state-dir")

    def close(self) -> None:
        """Fold the journal into the snapshot when this process holds the state dir alone (the
        next start reads one file), then release the state-dir lock."""
        if self._state_fd is not None and self._exclusive:
            self.compact()
        if self._state_fd is not None:
            os.close(self._state_fd)
            self._state_fd = None

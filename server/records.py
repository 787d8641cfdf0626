"""The registry's records: what the server keeps about each encoder, and the table file.

``registry.json`` in the state dir holds every :class:`EncoderRecord` and the aliases. It is
replaced as a whole: :meth:`RecordTable.commit` writes the new table atomically, then swaps
it into memory under the lock, so a crash leaves the old table or the new one, and readers
(the event loop) see one or the other, never a half-made change.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from qswap.atomic import atomic_write_json
from qswap.encoders.artifact import EncoderManifest
from qswap.errors import IntegrityError
from qswap.guard import GuardStatus
from qswap.locks import try_lock_exclusive

REGISTRY_FILE = "registry.json"
STATE_LOCK_FILE = ".lock"
FORMAT = 1


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
    guard: dict[str, Any] | None = None          # the manifest's own record (informational)
    guard_status: GuardStatus = GuardStatus.UNGUARDED
    forced: bool = False                         # force given: servable once its verdict is known
    evaluation: dict[str, Any] | None = None     # the server's own guard record (per-sentinel table)

    def __post_init__(self) -> None:
        self.guard_status = GuardStatus(self.guard_status)   # read back from JSON as a plain string

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


Records = dict[str, EncoderRecord]
Aliases = dict[str, str]


class RecordTable:
    """The records and aliases of one state dir, in memory and in ``registry.json``.

    ``records`` and ``aliases`` are replaced, never changed in place: a reader that took them
    under ``lock`` holds a consistent view. Changes go through :meth:`commit` (the caller
    serialises changes with its admin lock).
    """

    def __init__(self, state_dir: Path, lock: threading.RLock, saved: Callable[[], None] | None = None) -> None:
        self.state_dir = Path(state_dir)
        self.file = self.state_dir / REGISTRY_FILE
        self.lock = lock
        self.records: Records = {}
        self.aliases: Aliases = {}
        self._saved = saved
        self._state_fd: int | None = None

    def read(self) -> tuple[Records, Aliases]:
        """Parse ``registry.json`` (empty when there is none).

        Returns:
            (records, aliases) as stored.
        """
        if not self.file.exists():
            return {}, {}
        try:
            data = json.loads(self.file.read_text())
            records = {k: EncoderRecord(**v) for k, v in data.get("encoders", {}).items()}
            aliases = {str(k): str(v) for k, v in data.get("aliases", {}).items()}
        except (json.JSONDecodeError, TypeError, ValueError, AttributeError, UnicodeDecodeError) as e:
            raise IntegrityError(f"{self.file.name} in the state dir is not a valid registry file: {e}",
                                 "restore it from a backup, or move it away to start with no encoders") from None
        return records, aliases

    def commit(self, records: Records | None = None, aliases: Aliases | None = None) -> None:
        """Write the table with ``records`` and/or ``aliases`` replaced, then swap them in.

        Args:
            records: the new records (None: unchanged).
            aliases: the new aliases (None: unchanged).
        """
        with self.lock:
            new_records = self.records if records is None else records
            new_aliases = self.aliases if aliases is None else aliases
        self.save(new_records, new_aliases)
        with self.lock:
            self.records, self.aliases = new_records, new_aliases

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

    def save(self, records: Records, aliases: Aliases) -> None:
        """Write ``registry.json`` atomically (no memory change)."""
        atomic_write_json(self.file, {"format": FORMAT,
                                      "encoders": {k: asdict(r) for k, r in sorted(records.items())},
                                      "aliases": dict(sorted(aliases.items()))})
        if self._saved is not None:
            self._saved()

    # -- the state-dir lock ---------------------------------------------------------------------

    def lock_dir(self, take: Callable[[Path], int] | None = None) -> None:
        """Hold the state dir's lock file (exclusive unless ``take`` opens it otherwise)."""
        if self._state_fd is not None:
            return
        path = self.state_dir / STATE_LOCK_FILE
        # Two servers writing one registry file would lose each other's changes.
        self._state_fd = take(path) if take is not None else try_lock_exclusive(
            path, "the state dir is in use by another server", "give each server its own --state-dir")

    def close(self) -> None:
        """Release the state-dir lock (the table file is always up to date)."""
        if self._state_fd is not None:
            os.close(self._state_fd)
            self._state_fd = None

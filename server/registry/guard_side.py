"""The registry's side of its guard: what the guard scheduler reads and writes.

:class:`GuardSide` is part of :class:`~qswap.server.registry.facade.EncoderRegistry` (a base
class, kept in its own file): it implements
:class:`~qswap.server.registry.guard_scheduler.GuardHost`, so the scheduler asks the registry
what to evaluate and hands it verdicts without touching its tables or locks.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from qswap.encoders import BASE_KEY
from qswap.guard import GuardRecord, GuardStatus
from qswap.server.registry.records import RecordTable

log = logging.getLogger("qswap.server")


class GuardSide:
    """Guard-facing methods of the registry (its ``_lock``, ``admin_lock`` and ``table``)."""

    _lock: threading.RLock
    admin_lock: threading.Lock
    table: RecordTable
    is_deleting: Callable[[str], bool]

    def _digests(self, keys: list[str]) -> dict[str, str]:
        """key -> digest of its files (the base is itself); holds ``_lock``."""
        return {k: self.table.records[k].digest if k in self.table.records else k for k in keys}

    def guard_plan(self, fingerprint: str) -> tuple[list[str], list[str], dict[str, str], list[tuple[str, Any]]]:
        """At start: encoders without a verdict on sentinels ``fingerprint`` (marked evaluating),
        the encoders to warm (base and aliased), their digests, and the records with a verdict."""
        with self._lock:
            recs = self.table.records
            todo = [k for k, r in recs.items()
                    if r.guard_status in (GuardStatus.UNGUARDED, GuardStatus.EVALUATING, GuardStatus.FAILED)
                    or (r.evaluation.sentinels if r.evaluation else None) != fingerprint]
            warm = [BASE_KEY, *sorted({k for k in self.table.aliases.values() if k != BASE_KEY})]
            done = [(k, r) for k, r in recs.items() if k not in todo and r.evaluation]
            digests = self._digests(warm)
        with self.admin_lock:
            for key in todo:
                if self.table.records[key].guard_status in (GuardStatus.UNGUARDED, GuardStatus.FAILED):
                    self.table.update(key, guard_status=GuardStatus.EVALUATING)
        return todo, warm, digests, done

    def evaluation_targets(self, key: str) -> tuple[list[str], dict[str, str]] | None:
        """What ``key`` is judged against (base and every aliased encoder) and the digest of
        every judged encoder's files; None when ``key`` is gone or being deleted."""
        with self._lock:
            if key not in self.table.records or self.is_deleting(key):
                return None
            against = [BASE_KEY, *sorted({k for k in self.table.aliases.values()
                                          if k not in (BASE_KEY, key) and k in self.table.records})]
            return against, self._digests([key, *against])

    def write_verdict(self, key: str, digest: str, status: GuardStatus, record: GuardRecord) -> bool:
        """Store a verdict on ``key`` if its record still holds the files judged (``digest``)."""
        with self.admin_lock:
            with self._lock:
                rec = self.table.records.get(key)
            if rec is None or rec.digest != digest:
                log.warning("guard verdict dropped: the encoder was deleted or replaced during its evaluation",
                            extra={"encoder": key, "guard_status": status})
                return False
            try:
                self.table.update(key, guard_status=status, evaluation=record)
            except Exception:
                log.exception("could not store the guard verdict", extra={"encoder": key})
                return False
        return True

    def aliases_of(self, key: str) -> list[str]:
        """The domains whose alias points to ``key``, sorted."""
        with self._lock:
            return sorted(d for d, k in self.table.aliases.items() if k == key)


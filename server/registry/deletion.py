"""Deletion: unregistering an encoder (``DELETE /v1/encoders/{key}``, and a registration the guard refused).

:class:`DeletionSide` is part of :class:`~qswap.server.registry.facade.EncoderRegistry` (a base
class, kept in its own file). A delete refuses new requests for the encoder at once and waits,
on the registry's ``_released`` condition (not by polling), for the ones in flight; an encoder
that an alias points to, or that serves the requests naming none, is not deleted. The record
goes first (one journal line), then the encoder is detached and its stored copy removed.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Callable

from qswap.errors import ConflictError, InvalidInputError, NotFoundError
from qswap.server.registry.cache import EncoderCache
from qswap.server.registry.guard_scheduler import GuardScheduler
from qswap.server.registry.records import RecordTable
from qswap.server.registry.registration import DEFAULT_ALIAS
from qswap.server.registry.serving import Use, serving_error

log = logging.getLogger("qswap.server")


class DeletionSide:
    """Deletion methods of the registry (its tables, locks, reference counts and cache)."""

    store: Path
    scheduler: GuardScheduler | None
    table: RecordTable
    cache: EncoderCache
    _lock: threading.RLock
    _released: threading.Condition
    admin_lock: threading.Lock
    _refs: dict[str, int]
    _deleting: set[str]
    default_key: Callable[[], str]
    _gauges: Callable[[], None]

    def _unregister_unserved(self, key: str) -> None:
        """Drop an encoder nothing can be serving (refused while its registration waited)."""
        with self.admin_lock:
            with self._lock:
                if key not in self.table.records or key in self.table.aliases.values():
                    return
            self._remove(key)
        log.info("encoder refused by the guard and unregistered", extra={"encoder": key})

    def _remove(self, key: str) -> None:
        """Unregister ``key`` (file first), detach it and delete its stored copy (holds ``admin_lock``)."""
        self.table.commit(records=self.table.without(key))
        with self.cache.load_lock:
            self.cache.forget(key)
            self.cache.detach(key)
        if self.scheduler is not None:
            self.scheduler.forget(key)
        shutil.rmtree(self.store / key, ignore_errors=True)

    def delete(self, key: str, timeout_s: float = 30.0) -> None:
        """Unregister ``key`` after its in-flight requests finish (new ones are refused at once)."""
        if "@" not in key:
            raise InvalidInputError(f"delete needs an exact name@version, got {key!r}",
                                    "list the versions with GET /v1/encoders")
        with self.admin_lock:
            with self._lock:
                if key not in self.table.records:
                    raise NotFoundError(f"encoder {key} is not registered", "list encoders with GET /v1/encoders")
                domains = sorted(d for d, k in self.table.aliases.items() if k == key)
                if domains:
                    raise ConflictError(f"encoder {key} is the target of aliases {domains}",
                                        "point those aliases elsewhere or delete them first")
                if self._serving_default() == key:
                    raise ConflictError(f"encoder {key} is the default encoder",
                                        "configure another default encoder first")
                self._deleting.add(key)
                self._released.notify_all()   # whoever waits for the delete to begin (tests)
                try:
                    if not self._released.wait_for(lambda: not self._refs.get(key), timeout_s):
                        raise ConflictError(f"encoder {key} still has requests in flight after {timeout_s:.0f}s",
                                            "retry the delete when traffic to it has drained")
                except BaseException:
                    self._deleting.discard(key)
                    raise
            try:
                self._remove(key)
            finally:
                with self._lock:
                    self._deleting.discard(key)
        log.info("encoder deleted", extra={"encoder": key})
        self._gauges()

    def _serving_default(self) -> str | None:
        """The key requests naming no encoder are served by now, if any (holds ``_lock``): a
        default that may not serve (evaluating, refused) serves nothing, so it can be deleted."""
        try:
            key = self.default_key()
        except NotFoundError:
            return None
        rec = self.table.records.get(key)
        return key if DEFAULT_ALIAS in self.table.aliases or serving_error(rec, Use.DEFAULT) is None else None

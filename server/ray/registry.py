"""One encoder registry for every Ray Serve replica: the state dir, shared, with change detection.

Why the state dir and not a registry actor: the registry already *is* a directory (the
table, ``registry.json`` and its append-only journal, plus the server's verified copies of the encoder
files). Replicas must read those files to load an encoder anyway, so they need the directory
whatever holds the table; an actor would add a second copy of the truth, a process to keep
alive and a hop on every admission. Here:

- every replica opens the same ``--state-dir`` (one machine, or a shared volume: NFS, EFS, a
  ``ReadWriteMany`` PVC) and takes a *shared* lock on its ``.lock`` file, so replicas coexist
  while a plain ``qswap serve`` (which wants it exclusively) is refused;
- a change (register, delete, alias set/delete) runs under an exclusive ``flock`` on
  ``.admin.lock`` and first re-reads the table, so a change made on another replica is never
  overwritten; the rest is the single-process code path (same copy, checks, guard, errors);
- every replica polls the journal's size and the files' inodes every ``poll_s`` and reads
  only the journal lines it has not read yet (the whole table only when it was folded into a
  new snapshot meanwhile), and reads at once when a request names an encoder or domain it does
  not know yet: a change costs each replica one line, whatever the number of encoders. A registration
  acknowledged by one replica is therefore served by any other at once, and alias switches and
  deletions reach every replica within ``poll_s`` (0.2 s);
- nothing is lost when a replica or the Ray head restarts: the table is on disk before a change
  is acknowledged, and a (re)starting replica reads it under the admin lock.

Each replica keeps its own loaded-encoder LRU; an encoder deleted elsewhere is unloaded here
once its in-flight requests on this replica are done.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from qswap.encoders import BASE_KEY
from qswap.locks import exclusive_lock, try_lock
from qswap.errors import NotFoundError
from qswap.server.registry.records import EncoderRecord
from qswap.server.registry.facade import EncoderRegistry
from qswap.server.registry.serving import Use

log = logging.getLogger("qswap.server")

ADMIN_LOCK_FILE = ".admin.lock"
POLL_S = 0.2

class SharedRegistry(EncoderRegistry):
    """An :class:`EncoderRegistry` whose state dir is shared by several processes."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._xlock = threading.Lock()   # flock is per open file: serialise this process's threads too
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        self.reloads = 0
        self.detach_after_register = True

    # -- the cross-process admin lock ---------------------------------------------------------

    @contextmanager
    def shared_admin_lock(self) -> Iterator[None]:
        """Exclusive across every process sharing the state dir (blocking)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with self._xlock, exclusive_lock(self.state_dir / ADMIN_LOCK_FILE):
            yield

    def _lock_state_dir(self) -> None:
        # Shared: replicas coexist; a single-process server (exclusive) is refused, and so is
        # a replica while such a server runs.
        self.table.lock_dir(lambda path: try_lock(
            path, "the state dir is in use by a single-process server",
            "stop it, or give the Ray deployment its own --state-dir", shared=True))

    # -- reading the shared table -------------------------------------------------------------

    def load_state(self) -> None:
        # Under the admin lock: the base class drops stored copies the table does not list,
        # which would remove the copy another replica has renamed in but not yet listed.
        with self.shared_admin_lock():
            super().load_state()

    def reload_if_changed(self) -> bool:
        """Apply the changes another process committed since the last read; True when any did.

        Reads only the new journal lines (see :meth:`RecordTable.read_changes`); it may run on
        the event loop, inside ``acquire``."""
        if not self.table.read_changes():
            return False
        self.reloads += 1
        self._gauges()
        return True

    def _unload_unregistered(self) -> None:
        """Detach encoders another replica deleted, once nothing here uses them."""
        with self.cache.load_lock:
            with self._lock:
                gone = [k for k in self.cache.loaded if k not in self.table.records and not self._refs.get(k)]
                for k in gone:
                    self.cache.drop(k)
            for k in gone:
                self.cache.detach(k)
                log.info("encoder unloaded: deleted by another replica", extra={"encoder": k})

    def start_polling(self, poll_s: float = POLL_S) -> None:
        """Re-read the table every ``poll_s`` in a daemon thread."""
        if self._poller is not None:
            return

        def run() -> None:
            seen = -1
            while not self._stop.wait(poll_s):
                try:
                    self.reload_if_changed()
                    if self.reloads != seen:   # a change read here or by a request since the last look
                        seen = self.reloads
                        self._unload_unregistered()
                except Exception:   # keep polling: a bad read now may be a good one next time
                    log.exception("registry reload failed")

        self._poller = threading.Thread(target=run, name="qswap-registry-poll", daemon=True)
        self._poller.start()

    def close(self) -> None:
        self._stop.set()
        super().close()

    # -- resolution: an unknown name may be one registered elsewhere a moment ago ---------------

    def resolve(self, encoder: str | None = None, domain: str | None = None, use: Use = Use.NAME) -> str:
        try:
            return super().resolve(encoder, domain, use)
        except NotFoundError:
            if not self.reload_if_changed():
                raise
            return super().resolve(encoder, domain, use)

    def ensure_loaded(self, key: str) -> None:
        if key != BASE_KEY:
            with self._lock:
                known = key in self.table.records
            if not known:
                self.reload_if_changed()
        super().ensure_loaded(key)

    # -- changes: re-read under the admin lock, then the single-process code path ------------

    def _registered(self, fill: Callable[[Path], Path], label: str, force: bool, source: str,
                    wait: bool) -> tuple[EncoderRecord, bool]:
        # Both ways in (a directory, an extracted upload) end here.
        with self.shared_admin_lock():
            self.reload_if_changed()
            rec, created = super()._registered(fill, label, force, source, wait)
        if created and self.detach_after_register:
            # Registration attached it to check that it fits the base; which replicas hold it
            # is Ray Serve's multiplexing decision (its per-replica LRU), not this replica's.
            self.unload(rec.key)
        return rec, created

    def delete(self, key: str, timeout_s: float = 30.0) -> None:
        with self.shared_admin_lock():
            self.reload_if_changed()
            super().delete(key, timeout_s)

    def set_alias(self, domain: str, ref: str, force: bool = False, use: Use = Use.ALIAS,
                  expect: str | None = None) -> tuple[str, str | None]:
        with self.shared_admin_lock():
            self.reload_if_changed()
            return super().set_alias(domain, ref, force, use, expect)

    def delete_alias(self, domain: str) -> str:
        with self.shared_admin_lock():
            self.reload_if_changed()
            return super().delete_alias(domain)

    # -- the Ray Serve LRU ---------------------------------------------------------------------

    def unload(self, key: str) -> bool:
        """Detach ``key`` unless it is pinned (base, default, aliased) or in use; True if detached.

        Called when Ray Serve's per-replica LRU (``--max-encoders-per-replica``) drops it."""
        with self.cache.load_lock:
            with self._lock:
                if key not in self.cache.loaded or key in self._pinned() or self._refs.get(key):
                    return False
                self.cache.drop(key)
            self.cache.detach(key)
        if self.metrics is not None:
            self.metrics.evictions.inc()
        log.info("encoder evicted (replica LRU)", extra={"encoder": key})
        self._gauges()
        return True

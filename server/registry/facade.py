"""The encoder registry: what the server routes call to register, resolve, hold and delete encoders.

A façade over its parts, one concept each:

- :mod:`qswap.server.registry.intake`: bringing files in (register-by-path without following links,
  uploaded archives), into a staging folder of the store;
- :mod:`qswap.server.registry.records`: the records and aliases, and their files (``registry.json`` and
  its journal; one commit step: the change's journal line first, then one swap in memory);
- :mod:`qswap.server.registry.cache`: the encoders attached to the pool, an LRU under a budget;
- :mod:`qswap.server.registry.guard_scheduler`: the server's own guard (``--sentinels``) and its verdicts;
- the registry's methods by concern, as base classes of :class:`EncoderRegistry`:
  :mod:`~qswap.server.registry.registration` (register), :mod:`~qswap.server.registry.deletion`
  (delete), :mod:`~qswap.server.registry.aliases` (set and delete aliases) and
  :mod:`~qswap.server.registry.guard_side` (what the guard scheduler reads and writes).

What this module decides:

- **Resolution.** A request resolves ``encoder`` / ``domain`` / the default to an exact key *at
  admission* and holds a reference until it is finished; alias switches swap one dict, so a
  request runs on the version it was admitted with. A bare name (and the configured default
  encoder, resolved like a name) means its highest *servable* version: a newer version still
  evaluating or refused does not block it.
- **The guard fails closed.** Whether an encoder may serve is asked of one function,
  :func:`qswap.server.registry.serving.serving_error`, with the use the caller makes of it (by
  name, as the default, behind an alias, as an experiment's candidate, promoted, rolled back to);
  its table says which uses a forced encoder may have. Nothing serves while it is ``evaluating``,
  forced or not. An alias was checked when it was set; an alias whose encoder is re-evaluated at
  start keeps serving (a restart must not take a domain down), with an error logged if the new
  verdict refuses it.
- **References.** Deletion (:mod:`~qswap.server.registry.deletion`) refuses new requests at
  once and waits on ``_released`` for the references taken here.

Locks: ``_lock`` guards the in-memory tables and is never held across model code or disk
work (the event loop takes it); the cache's ``load_lock`` serialises pool changes;
``admin_lock`` serialises registrations, deletions, alias changes and verdicts.
"""

from __future__ import annotations

import bisect
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

from qswap.answers import EncoderInfo
from qswap.encoders import BASE_KEY, EncoderPool, load_encoder
from qswap.encoders.artifact import ENCODER_MANIFEST
from qswap.errors import NotFoundError
from qswap.server.registry import intake
from qswap.server.registry.aliases import AliasSide
from qswap.server.registry.cache import EncoderCache
from qswap.server.registry.deletion import DeletionSide
from qswap.server.registry.guard_scheduler import GuardScheduler
from qswap.server.registry.guard_side import GuardSide
from qswap.server.registry.lease import Lease
from qswap.server.registry.records import EncoderRecord, RecordTable, version_order
from qswap.server.registry.registration import DEFAULT_ALIAS, INCOMING, RegistrationSide
from qswap.server.registry.serving import Use, is_forced, serving_error
from qswap.space import EmbeddingSpace

log = logging.getLogger("qswap.server")


class EncoderRegistry(RegistrationSide, DeletionSide, AliasSide, GuardSide):
    """See the module docstring. Blocking methods (``register``, ``delete``, ``set_alias``,
    ``ensure_loaded``) must run off the event loop; ``acquire``/``release``/lookups are cheap."""

    def __init__(self, *, state_dir: Path, pool: EncoderPool, space: EmbeddingSpace, backend: Any,
                 default_encoder: str = BASE_KEY, memory_budget: int = 1 << 30, metrics: Any = None,
                 guard: Any = None) -> None:
        self.state_dir = Path(state_dir)
        self.store = self.state_dir / "encoders"
        self.pool = pool
        self.space = space
        self.backend = backend
        self.default_ref = default_encoder
        self.metrics = metrics
        self.guard = guard                      # a qswap.guard.evaluator.GuardEvaluator, or None
        self._lock = threading.RLock()
        self._released = threading.Condition(self._lock)   # a reference was released (delete waits)
        self.admin_lock = threading.Lock()
        self.table = RecordTable(self.state_dir, self._lock)
        self.cache = EncoderCache(pool, backend, memory_budget, self._lock, metrics)
        self.scheduler = GuardScheduler(self, guard) if guard is not None else None
        self._refs: dict[str, int] = {}
        self._deleting: set[str] = set()

    @property
    def file(self) -> Path:
        return self.table.file

    # -- persistence --------------------------------------------------------------------------

    def load_state(self) -> None:
        """Lock the state dir, read the registry files, drop entries whose stored copy is gone.

        Nothing stored is hashed here (an encoder's files are verified when it is loaded), so
        the start costs one stat per registered encoder."""
        self.store.mkdir(parents=True, exist_ok=True)
        self._lock_state_dir()
        stored = self.table.read()
        with self._lock:
            self.table.swap(*stored)
        records, aliases = dict(stored[0]), dict(stored[1])
        changed = False
        for key in list(records):
            if not (self.store / key / ENCODER_MANIFEST).is_file():
                log.error("registered encoder has no stored copy; dropping it", extra={"encoder": key})
                del records[key]
                changed = True
        for dom, key in list(aliases.items()):
            if key != BASE_KEY and key not in records:
                log.error("alias points to an unknown encoder; dropping it", extra={"domain": dom, "encoder": key})
                del aliases[dom]
                changed = True
        for p in self.store.iterdir():
            if p.name.startswith(INCOMING) or (p.is_dir() and "@" in p.name and p.name not in records):
                shutil.rmtree(p, ignore_errors=True)   # a crash mid-registration left it
        if changed:
            self.table.commit(records, aliases)   # one journal line: what was dropped
        self.table.compact()   # the next reader starts from one file
        self._gauges()

    def _lock_state_dir(self) -> None:
        self.table.lock_dir()

    def close(self) -> None:
        """Release the state-dir lock (the registry file is always up to date)."""
        self.table.close()

    # -- resolution and reference counts ------------------------------------------------------

    def _resolve_ref(self, ref: str, use: Use = Use.NAME) -> str:
        records = self.table.records
        if ref == BASE_KEY:
            return BASE_KEY
        if "@" in ref:
            if ref in records and ref not in self._deleting:
                return ref
            raise NotFoundError(f"encoder {ref} is not registered", "list encoders with GET /v1/encoders")
        versions = [records[k] for k in self.table.by_name.get(ref, ()) if k not in self._deleting]
        if not versions:
            raise NotFoundError(f"no encoder named {ref!r} is registered",
                                "list encoders with GET /v1/encoders, or register one with POST /v1/encoders")
        # The highest version allowed for ``use`` (a newer one still evaluating or refused does not
        # block the name); none allowed: the highest, whose guard error the caller then reports.
        # Equal orders (e.g. "1.0" and "1.00") fall back to the latest registered.
        versions.sort(key=lambda r: (version_order(r.version), r.registered_at), reverse=True)
        return next((r.key for r in versions if serving_error(r, use) is None), versions[0].key)

    def default_key(self) -> str:
        """The encoder that answers requests naming none: the ``default`` alias, else the
        configured default encoder resolved like a name (its highest servable version)."""
        with self._lock:
            return self.table.aliases.get(DEFAULT_ALIAS) or self._resolve_ref(self.default_ref, Use.DEFAULT)

    def resolve(self, encoder: str | None = None, domain: str | None = None, use: Use = Use.NAME) -> str:
        """Exact key for an encoder name/key, a domain alias, or (neither) the default (``use``:
        how a bare name picks its version, see :meth:`_resolve_ref`)."""
        with self._lock:   # "not both" is checked by the request model (qswap.server.http.models)
            if domain is not None:
                key = self.table.aliases.get(domain)
                if key is None:
                    known = ", ".join(sorted(self.table.aliases)) or "none"
                    raise NotFoundError(f"no alias for domain {domain!r}", f"known domains: {known}")
                return key
            if encoder is None:
                return self.default_key()
            return self._resolve_ref(encoder, use)

    def acquire(self, encoder: str | None = None, domain: str | None = None, use: Use | None = None) -> str:
        """Resolve and hold a reference: the key stays registered and loaded until :meth:`release`.

        Args:
            encoder: a name or ``name@version``.
            domain: a domain alias (not both).
            use: how the caller chooses it (default: by what it names: :attr:`Use.DOMAIN`,
                :attr:`Use.NAME`, or :attr:`Use.DEFAULT` when it names neither); the serving gate
                (:func:`~qswap.server.registry.serving.serving_error`) decides.
        """
        if use is None:
            use = Use.DOMAIN if domain is not None else Use.NAME if encoder is not None else Use.DEFAULT
        with self._lock:
            key = self.resolve(encoder, domain, use)
            if use == Use.DEFAULT and DEFAULT_ALIAS in self.table.aliases:
                use = Use.DOMAIN   # the 'default' alias was gated when it was set
            self._require_servable(key, use)
            self._refs[key] = self._refs.get(key, 0) + 1
            self.cache.touch(key)
            return key

    def lease(self, encoder: str | None = None, domain: str | None = None, use: Use | None = None) -> Lease:
        """:meth:`acquire` as a :class:`Lease` (share it with jobs; released once, by the last holder)."""
        key = self.acquire(encoder, domain, use=use)
        return Lease(key, lambda: self.release(key))

    def held(self, key: str) -> Lease:
        """:meth:`hold` as a :class:`Lease` (the guard's own use of an encoder)."""
        self.hold(key)
        return Lease(key, lambda: self.release(key))

    def _require_servable(self, key: str, use: Use, force: bool = False) -> None:
        """Raise unless ``key`` may serve for ``use`` (holds ``_lock``): the serving gate."""
        err = serving_error(self.table.records.get(key), use, force)
        if err is not None:
            raise err

    def may_serve(self, key: str, use: Use, force: bool = False) -> bool:
        """Whether ``key`` (registered, or the base) may serve for ``use`` now: the serving gate,
        for listings."""
        if key == BASE_KEY:
            return True
        with self._lock:
            rec = self.table.records.get(key)
            return rec is not None and serving_error(rec, use, force) is None

    def forced(self, key: str) -> bool:
        """Whether ``key`` answers only because an admin forced it (answers mark it)."""
        with self._lock:
            return is_forced(self.table.records.get(key))

    def hold(self, key: str) -> None:
        """A reference without any check (the guard's own use of an encoder)."""
        with self._lock:
            self._refs[key] = self._refs.get(key, 0) + 1

    def release(self, key: str) -> None:
        """Drop one reference taken by :meth:`acquire` or :meth:`hold` (a waiting delete wakes)."""
        with self._lock:
            n = self._refs.get(key, 0) - 1
            if n > 0:
                self._refs[key] = n
            else:
                self._refs.pop(key, None)
                self._released.notify_all()

    def in_flight(self, key: str) -> int:
        """References held on ``key`` now (requests in flight, the guard's own use)."""
        with self._lock:
            return self._refs.get(key, 0)

    def is_deleting(self, key: str) -> bool:
        """Whether a delete of ``key`` is waiting for its references (new requests are refused)."""
        with self._lock:
            return key in self._deleting

    def is_loaded(self, key: str) -> bool:
        """Whether ``key`` is attached to the pool (the base always is)."""
        return key in self.cache

    def _pinned(self) -> set[str]:
        pinned = {BASE_KEY, *self.table.aliases.values()}
        try:
            pinned.add(self.default_key())
        except NotFoundError:
            pass
        return pinned

    def _busy(self) -> set[str]:
        """Encoders the cache must keep (holds ``_lock``): pinned or in use."""
        return self._pinned() | {k for k, n in self._refs.items() if n}

    # -- loading ------------------------------------------------------------------------------

    def ensure_loaded(self, key: str) -> None:
        """Attach ``key`` to the pool if it is not (blocking: reads and verifies the stored copy)."""
        if self.is_loaded(key):
            return
        with self.cache.load_lock:
            with self._lock:
                if key in self.cache.loaded:
                    return
                if key not in self.table.records:
                    raise NotFoundError(f"encoder {key} is not registered", "list encoders with GET /v1/encoders")
            with intake.server_paths_hidden({self.state_dir: "<state-dir>"}):
                art = load_encoder(self.store / key, self.space)   # re-verifies checksums of the stored copy
            self.pool.add(art)
            self.cache.count(key)
            log.info("encoder loaded", extra={"encoder": key, "bytes": self.cache.loaded.get(key)})
            self.cache.evict(keep=key, busy=self._busy)
        self._gauges()

    def _gauges(self) -> None:
        if self.metrics is None:
            return
        with self._lock:
            self.metrics.encoders_loaded.set(len(self.cache.loaded) + 1)
            self.metrics.encoders_loaded_bytes.set(self.cache.total)
            self.metrics.encoders_registered.set(len(self.table.records))

    # -- the server's own guard -----------------------------------------------------------------

    def start_guard(self) -> None:
        """At start: evaluate encoders without a verdict on these sentinels (see the scheduler)."""
        if self.scheduler is not None:
            self.scheduler.start()

    def stop_guard(self) -> None:
        """At shutdown: queued evaluations are dropped; a running one stores nothing."""
        if self.scheduler is not None:
            self.scheduler.stop()

    def wait_for_guard(self, key: str, timeout: float | None = None) -> None:
        """Block until ``key``'s pending evaluation (if any) is done (tests and the CLI)."""
        if self.scheduler is not None:
            self.scheduler.wait(key, timeout)

    # -- views ---------------------------------------------------------------------------------

    def aliases(self) -> dict[str, str]:
        """domain -> encoder key, a copy."""
        with self._lock:
            return dict(self.table.aliases)

    def keys(self) -> list[str]:
        """Registered keys (the base not included), sorted."""
        with self._lock:
            return list(self.table.sorted_keys)

    def page(self, after: str | None = None, limit: int | None = None) -> tuple[list[str], str | None]:
        """One page of the listing ``[base, *sorted keys]``: the keys after the cursor ``after``.

        Args:
            after: the last key of the previous page (None: from the start, the base first).
            limit: at most this many keys (None: all the rest).

        Returns:
            (keys, next): the page, and the cursor of the next one (None on the last page).
        """
        with self._lock:
            keys = self.table.sorted_keys
            if after is None:
                start, head = 0, [BASE_KEY]
            else:
                start, head = (0 if after == BASE_KEY else bisect.bisect_right(keys, after)), []
            if limit is None:
                return head + keys[start:], None
            page = (head + keys[start:start + limit])[:limit]
            more = start + len(page) - len(head) < len(keys)
            return page, page[-1] if more and page else None

    def record(self, key: str) -> EncoderRecord | None:
        """The record of ``key`` (None when it is not registered)."""
        with self._lock:
            return self.table.records.get(key)

    def info(self, key: str, base_version: str) -> EncoderInfo:
        """What ``GET /v1/encoders/{key}`` answers of one encoder (``base`` included), less its runtime."""
        with self._lock:
            pinned = self._pinned()
            aliases = sorted(d for d, k in self.table.aliases.items() if k == key)
            if key == BASE_KEY:
                return EncoderInfo(key=BASE_KEY, name=BASE_KEY, version=base_version, kind="identity",
                                   space=self.space.fingerprint, loaded=True, pinned=True,
                                   in_flight=self._refs.get(key, 0), memory_bytes=0, aliases=aliases,
                                   source="base model")
            rec = self.table.records.get(key)
            if rec is None:
                raise NotFoundError(f"encoder {key} is not registered", "list encoders with GET /v1/encoders")
            return EncoderInfo(key=rec.key, name=rec.name, version=rec.version, kind=rec.kind, space=rec.space,
                               created_at=rec.created_at, registered_at=rec.registered_at, source=rec.source,
                               training=rec.training, guard=rec.guard, guard_status=rec.guard_status,
                               forced=rec.forced, evaluation=rec.evaluation, loaded=key in self.cache.loaded,
                               pinned=key in pinned, in_flight=self._refs.get(key, 0),
                               memory_bytes=self.cache.loaded.get(key), aliases=aliases)

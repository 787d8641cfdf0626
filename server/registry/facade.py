"""The encoder registry: what the server routes call to register, resolve, hold and delete encoders.

A façade over four parts, one concept each:

- :mod:`qswap.server.registry.intake`: bringing files in (register-by-path without following links,
  uploaded archives), into a staging folder of the store;
- :mod:`qswap.server.registry.records`: the records and aliases, and their files (``registry.json`` and
  its journal; one commit step: the change's journal line first, then one swap in memory);
- :mod:`qswap.server.registry.cache`: the encoders attached to the pool, an LRU under a budget;
- :mod:`qswap.server.registry.guard_scheduler`: the server's own guard (``--sentinels``) and its verdicts.

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
- **Deletion** refuses new requests at once and waits (on a condition, not by polling) for the
  ones in flight.

Locks: ``_lock`` guards the in-memory tables and is never held across model code or disk
work (the event loop takes it); the cache's ``load_lock`` serialises pool changes;
``admin_lock`` serialises registrations, deletions, alias changes and verdicts.
"""

from __future__ import annotations

import bisect
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from qswap.encoders import BASE_KEY, EncoderPool, load_encoder
from qswap.encoders.artifact import ENCODER_MANIFEST, EncoderArtifact, validate_name
from qswap.errors import ConflictError, InvalidInputError, NotFoundError, QswapError
from qswap.guard import GuardStatus
from qswap.server.registry import intake
from qswap.server.registry.cache import EncoderCache
from qswap.server.registry.guard_scheduler import GuardScheduler
from qswap.server.registry.intake import EncoderDir
from qswap.server.registry.records import (REGISTRY_FILE, STATE_LOCK_FILE, EncoderRecord, RecordTable, split_key,
                                  version_order)
from qswap.space import EmbeddingSpace
from qswap.guard.checks import check_guard
from qswap.server.registry.serving import Use, is_forced, serving_error

__all__ = ["DEFAULT_ALIAS", "REGISTRY_FILE", "STATE_LOCK_FILE", "EncoderRecord", "EncoderRegistry", "GuardStatus",
           "split_key", "version_order"]

log = logging.getLogger("qswap.server")

DEFAULT_ALIAS = "default"   # an alias with this name overrides the configured default encoder
_INCOMING = ".incoming-"


def check_manifest_guard(guard: dict[str, Any] | None, force: bool) -> None:
    """The manifest's self-reported guard: a recorded failure refuses unless ``force``; a pass
    proves nothing (anyone can write it) and decides nothing when the server has sentinels."""
    if force:
        if isinstance(guard, dict) and guard.get("passed") is False:
            log.warning("manifest guard failure overridden by force")
        return
    check_guard(guard)


class EncoderRegistry:
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
        self.guard = guard                      # a qswap.guard.evaluator.SentinelGuard, or None
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
            if p.name.startswith(_INCOMING) or (p.is_dir() and "@" in p.name and p.name not in records):
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

    # -- registration ---------------------------------------------------------------------------

    def register(self, src: Path | EncoderDir, *, force: bool = False, source: str = "",
                 wait: bool = False) -> tuple[EncoderRecord, bool]:
        """Copy, verify and attach the encoder directory ``src``.

        With sentinels the record comes back ``evaluating`` while the server's evaluation runs
        in the background, unless ``wait``: then this returns once the verdict is in, and a
        refused (or failed) encoder is unregistered again and raises :class:`GuardRefusedError`
        carrying the table, so a refused request changes nothing.

        Args:
            src: a directory held open (:func:`qswap.server.registry.intake.open_under_root`: what was
                checked is what is copied), or a path the server trusts (opened here, no link
                followed).
            force: accept a refused verdict (the manifest's, or the server's once known).
            source: where it came from (kept on the record).
            wait: answer after the server's own verdict.

        Returns:
            (record, created): created is False when the identical encoder was registered.
        """
        def copy_into(work: Path, opened: EncoderDir) -> Path:
            intake.copy_encoder(opened, work)
            return work

        if isinstance(src, EncoderDir):
            return self._registered(lambda work: copy_into(work, src), src.label, force, source, wait)
        with intake.open_dir(Path(src)) as opened:
            return self._registered(lambda work: copy_into(work, opened), opened.label, force, source, wait)

    def register_extracted(self, extract: Callable[[Path], Path], *, label: str, force: bool = False,
                           source: str = "", wait: bool = False) -> tuple[EncoderRecord, bool]:
        """Like :meth:`register`, for files an ``extract(work)`` call writes straight into a
        staging folder of the store (an uploaded archive: extracted once, never copied again).

        Args:
            extract: writes the encoder into the empty folder ``work`` and returns the encoder
                directory (``work`` or a folder in it).
            label: how messages name the upload.
            force: see :meth:`register`.
            source: see :meth:`register`.
            wait: see :meth:`register`.

        Returns:
            (record, created).
        """
        return self._registered(extract, label, force, source, wait)

    def _registered(self, fill: Callable[[Path], Path], label: str, force: bool, source: str,
                    wait: bool) -> tuple[EncoderRecord, bool]:
        try:
            rec, created, job = self._register(fill, label, force, source)
            if wait and job is not None:
                rec = self._await_verdict(rec.key, job, drop=created)
        except QswapError:
            if self.metrics is not None:
                self.metrics.registrations.labels(result="refused").inc()
            raise
        if self.metrics is not None:
            self.metrics.registrations.labels(result="created" if created else "exists").inc()
        self._gauges()
        return rec, created

    def _await_verdict(self, key: str, job: Future, drop: bool) -> EncoderRecord:
        job.result()
        with self._lock:
            rec = self.table.records.get(key)
        if rec is None:
            raise NotFoundError(f"encoder {key} was deleted during its evaluation", "register it again")
        err = serving_error(rec, Use.NAME)
        if err is not None:
            if drop:
                self._unregister_unserved(key)
            raise err
        return rec

    def _staged(self, fill: Callable[[Path], Path], work: Path, label: str) -> EncoderArtifact:
        """Fill ``work`` and load what it holds (manifest, checksums, then the space): everything
        after this reads the staged files, so what is verified is what is stored and served."""
        with intake.server_paths_hidden({work: label, self.state_dir: "<state-dir>"}):
            enc_dir = fill(work)
            art = load_encoder(enc_dir, self.space)
            intake.keep_listed(enc_dir, art.manifest)
        return art

    def _register(self, fill: Callable[[Path], Path], label: str, force: bool,
                  source: str) -> tuple[EncoderRecord, bool, Future | None]:
        with self.admin_lock:
            self.store.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix=_INCOMING, dir=self.store))
            try:
                art = self._staged(fill, work, label)
                manifest = art.manifest
                validate_name(manifest.name)
                validate_name(manifest.version, "encoder version")
                key = manifest.key
                if manifest.name.lower() in (BASE_KEY, DEFAULT_ALIAS):   # "BASE" would read as the base
                    raise ConflictError(f"encoder name {manifest.name!r} is reserved (in any case)",
                                        "rename the encoder")
                with self._lock:
                    existing = self.table.records.get(key)
                if existing is not None:
                    if existing.files == manifest.files and existing.kind == manifest.kind:
                        return self._register_again(existing, force)
                    raise ConflictError(f"encoder {key} is already registered with different files",
                                        "register the new files under a new version")
                check_manifest_guard(manifest.guard, force)
                rec = EncoderRecord.from_manifest(manifest, source)
                rec.forced = force
                rec.guard_status = GuardStatus.EVALUATING if self.guard is not None else GuardStatus.UNGUARDED
                self._store_new(art, rec)
                job = self.scheduler.schedule(key) if self.scheduler is not None else None
            finally:
                shutil.rmtree(work, ignore_errors=True)
        log.info("encoder registered", extra={"encoder": key, "kind": rec.kind, "source": source,
                                              "guard_status": rec.guard_status, "forced": force})
        return rec, True, job

    def _store_new(self, art: EncoderArtifact, rec: EncoderRecord) -> None:
        """Attach ``art``, move its staged folder into the store and commit its record."""
        key, target = rec.key, self.store / rec.key
        with self.cache.load_lock:
            self.pool.add(art)   # refuses an adapter that does not fit the base
            try:
                if target.exists():
                    shutil.rmtree(target)   # an unregistered leftover
                os.replace(art.path, target)
                with self._lock:
                    records = {**self.table.records, key: rec}
                self.table.commit(records=records)
            except BaseException:
                self.pool.remove(key)
                shutil.rmtree(target, ignore_errors=True)
                raise
            self.cache.count(key)   # prepared before the guard encodes with it
            self.cache.evict(keep=key, busy=self._busy)

    def _register_again(self, existing: EncoderRecord, force: bool) -> tuple[EncoderRecord, bool, Future | None]:
        """The identical encoder is registered already (holds ``admin_lock``): ``force`` accepts
        a known verdict; a failed evaluation is retried; a pending one is returned with its job."""
        key = existing.key
        if force and not existing.forced and not existing.guard_status.servable:
            existing = self.table.update(key, forced=True)   # serves once its verdict is known
        if existing.guard_status == GuardStatus.EVALUATING:
            return existing, False, self.scheduler.jobs.get(key) if self.scheduler is not None else None
        if existing.guard_status == GuardStatus.FAILED and self.scheduler is not None:
            rec = self.table.update(key, guard_status=GuardStatus.EVALUATING)
            return rec, False, self.scheduler.schedule(key)
        if not force:
            with self._lock:
                self._require_servable(key, Use.NAME)
        return existing, False, None

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

    # -- deletion and aliases -------------------------------------------------------------------

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

    def set_alias(self, domain: str, ref: str, force: bool = False, use: Use = Use.ALIAS,
                  expect: str | None = None) -> tuple[str, str | None]:
        """Point ``domain`` at ``ref`` (loaded first, so the switch costs traffic nothing): the one
        way an alias is written.

        The serving gate decides for ``use``: :attr:`Use.ALIAS` (an admin) refuses an encoder under
        evaluation even with ``force`` and a refused (insufficient evidence, failed) one unless
        ``force``, which records the encoder as forced (it then serves by name too); promotion
        and rollback ask for their own use (a forced candidate is never promoted).

        Args:
            domain: the alias.
            ref: a name or ``name@version``.
            force: given by the admin in this request.
            use: who switches it (:attr:`Use.ALIAS`, :attr:`Use.PROMOTE`, :attr:`Use.ROLLBACK`).
            expect: switch only if the alias points at this key now (409 otherwise), checked
                under the admin lock: a promotion or rollback never overwrites an admin's change.

        Returns:
            The key now served and the previous one.
        """
        validate_name(domain, "domain")
        if domain.lower() == DEFAULT_ALIAS and domain != DEFAULT_ALIAS:
            raise InvalidInputError(f"domain {domain!r} is a case variant of the reserved alias "
                                    f"{DEFAULT_ALIAS!r}", f"use {DEFAULT_ALIAS!r} or another name")
        with self.admin_lock:
            with self._lock:
                if expect is not None and self.table.aliases.get(domain) != expect:
                    raise ConflictError(f"domain {domain!r} no longer points at {expect}",
                                        "the alias changed meanwhile: look at GET /v1/aliases and decide again")
                key = self.resolve(encoder=ref, use=use)
                self._require_servable(key, use, force)
                rec = self.table.records.get(key)
                self._refs[key] = self._refs.get(key, 0) + 1   # held so it cannot be evicted before it is pinned
            try:
                if rec is not None and is_forced(rec) and not rec.forced:   # accepted by force: on record
                    self.table.update(key, forced=True)
                self.ensure_loaded(key)
                with self._lock:
                    previous = self.table.aliases.get(domain)
                    aliases = {**self.table.aliases, domain: key}
                self.table.commit(aliases=aliases)   # one reference swap: requests see old or new
            finally:
                self.release(key)
        log.info("alias set", extra={"domain": domain, "encoder": key, "previous": previous})
        return key, previous

    def delete_alias(self, domain: str) -> str:
        """Remove the alias ``domain``; returns the key it pointed at."""
        with self.admin_lock:
            with self._lock:
                if domain not in self.table.aliases:
                    raise NotFoundError(f"no alias for domain {domain!r}", "list aliases with GET /v1/aliases")
                key = self.table.aliases[domain]
                aliases = {d: k for d, k in self.table.aliases.items() if d != domain}
            self.table.commit(aliases=aliases)
        log.info("alias deleted", extra={"domain": domain, "encoder": key})
        return key

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

    def info(self, key: str, base_version: str) -> dict[str, Any]:
        """A JSON-able description of one encoder (``base`` included)."""
        with self._lock:
            pinned = self._pinned()
            aliases = sorted(d for d, k in self.table.aliases.items() if k == key)
            if key == BASE_KEY:
                return {"key": BASE_KEY, "name": BASE_KEY, "version": base_version, "kind": "identity",
                        "space": self.space.fingerprint, "loaded": True, "pinned": True,
                        "in_flight": self._refs.get(key, 0), "memory_bytes": 0, "aliases": aliases,
                        "source": "base model"}
            rec = self.table.records.get(key)
            if rec is None:
                raise NotFoundError(f"encoder {key} is not registered", "list encoders with GET /v1/encoders")
            return {**asdict(rec), "loaded": key in self.cache.loaded, "pinned": key in pinned,
                    "in_flight": self._refs.get(key, 0), "memory_bytes": self.cache.loaded.get(key),
                    "aliases": aliases}

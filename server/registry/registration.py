"""Registration: bringing an encoder into the registry (what ``POST /v1/encoders`` runs).

:class:`RegistrationSide` is part of :class:`~qswap.server.registry.facade.EncoderRegistry` (a
base class, kept in its own file, like :class:`~qswap.server.registry.guard_side.GuardSide`).
One path for both ways in (a directory under ``--encoders-root``, an uploaded archive): the
files are filled into a staging folder of the store (:mod:`qswap.server.registry.intake`),
loaded and verified from there, attached to the pool (which refuses an adapter that does not
fit the base), moved into the store and committed as one journal line; with sentinels the
server's guard then evaluates it (:mod:`qswap.server.registry.guard_scheduler`). A refused
registration changes nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

from qswap.encoders import BASE_KEY, EncoderPool, load_encoder
from qswap.encoders.artifact import EncoderArtifact
from qswap.errors import ConflictError, NotFoundError, QswapError
from qswap.guard import GuardStatus
from qswap.guard.checks import check_guard
from qswap.names import validate_name
from qswap.server.registry import intake
from qswap.server.registry.cache import EncoderCache
from qswap.server.registry.guard_scheduler import GuardScheduler
from qswap.server.registry.intake import EncoderDir
from qswap.server.registry.records import EncoderRecord, RecordTable
from qswap.server.registry.serving import Use, needs_force, serving_error
from qswap.space import EmbeddingSpace

log = logging.getLogger("qswap.server")

DEFAULT_ALIAS = "default"   # an alias with this name overrides the configured default encoder
INCOMING = ".incoming-"     # staging folders of the store (a crash mid-registration leaves one)


def check_manifest_guard(guard: dict[str, Any] | None, force: bool) -> None:
    """The manifest's self-reported guard: a recorded failure refuses unless ``force``; a pass
    proves nothing (anyone can write it) and decides nothing when the server has sentinels."""
    if force:
        if isinstance(guard, dict) and guard.get("passed") is False:
            log.warning("manifest guard failure overridden by force")
        return
    check_guard(guard)


class RegistrationSide:
    """Registration methods of the registry (its tables, locks, cache and scheduler)."""

    state_dir: Path
    store: Path
    pool: EncoderPool
    space: EmbeddingSpace
    metrics: Any
    guard: Any
    scheduler: GuardScheduler | None
    table: RecordTable
    cache: EncoderCache
    _lock: threading.RLock
    admin_lock: threading.Lock
    _busy: Callable[[], set[str]]
    _gauges: Callable[[], None]
    _require_servable: Callable[..., None]
    _unregister_unserved: Callable[[str], None]

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
            work = Path(tempfile.mkdtemp(prefix=INCOMING, dir=self.store))
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
        if force and not existing.forced and needs_force(existing):
            existing = self.table.update(key, forced=True)   # serves once its verdict is known
        if existing.guard_status == GuardStatus.EVALUATING:
            return existing, False, self.scheduler.job(key) if self.scheduler is not None else None
        if existing.guard_status == GuardStatus.FAILED and self.scheduler is not None:
            rec = self.table.update(key, guard_status=GuardStatus.EVALUATING)
            return rec, False, self.scheduler.schedule(key)
        if not force:
            with self._lock:
                self._require_servable(key, Use.NAME)
        return existing, False, None

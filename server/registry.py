"""Registered encoders, aliases, in-flight reference counts and the loaded-encoder LRU.

- Registration copies the encoder directory into the server's own store (so later edits of
  the source change nothing), verifies the copy (checksums, embedding space) and attaches it to
  the pool (which checks that the adapter fits the base). The registry file (``registry.json``
  in the state dir) is written atomically before memory changes.
- With sentinels (``--sentinels``), every new encoder is evaluated by the server itself
  (:mod:`qswap.server.sentinels`) on a background thread; its record carries the verdict
  (``guard_status``: evaluating / passed / refused / failed) and the per-sentinel table
  (``evaluation``). The guard fails closed: only ``passed`` (or ``forced``) encoders are
  served by name or can be put behind an alias. The manifest's own guard record is
  informational, except that a self-reported failure is refused unless forced. Without
  sentinels encoders are ``unguarded`` and servable.
- A request resolves ``encoder`` / ``domain`` / default to an exact key *at admission* and
  holds a reference until it is finished; alias switches swap one dict (atomic), so a request
  runs on the version it was admitted with. Deleting an encoder waits for its references.
- Loaded encoders live in an LRU under a byte budget (``EncoderPool.memory_bytes``); the
  default encoder and aliased ones are pinned; others load again on first use.

Locks: ``_lock`` guards the in-memory tables and is never held across model code or disk
work (the event loop takes it); ``_load_lock`` serialises pool changes; ``_admin_lock``
serialises registrations, deletions and alias changes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from qswap.atomic import atomic_write_json
from qswap.encoders import BASE_KEY, EncoderPool, load_encoder
from qswap.encoders.artifact import ENCODER_MANIFEST, EncoderManifest, validate_name
from qswap.server import intake
from qswap.server.intake import EncoderDir
from qswap.locks import try_lock_exclusive
from qswap.errors import (ConflictError, GuardPendingError, GuardRefusedError, IntegrityError, InvalidInputError,
                          NotFoundError, QswapError)
from qswap.space import EmbeddingSpace
from qswap.tuning.guard import check_guard, guard_table, insufficient_table

log = logging.getLogger("qswap.server")

REGISTRY_FILE = "registry.json"
STATE_LOCK_FILE = ".lock"
FORMAT = 1
DEFAULT_ALIAS = "default"   # an alias with this name overrides the configured default encoder
_INCOMING = ".incoming-"


class GuardStatus(StrEnum):
    """The server's verdict on one encoder (str-valued: the registry file and JSON answers hold
    the plain strings)."""

    EVALUATING = "evaluating"       # queued or running: never served, not even when forced
    PASSED = "passed"               # no sentinel significantly worse
    REFUSED = "refused"             # a sentinel significantly worse
    INSUFFICIENT = "insufficient_evidence"   # a sentinel has fewer judged queries left than the minimum
    FAILED = "failed"               # the evaluation itself broke
    UNGUARDED = "unguarded"         # the server has no sentinels


SERVABLE = (GuardStatus.PASSED, GuardStatus.UNGUARDED)   # served without force


def is_servable(rec: "EncoderRecord") -> bool:
    """Whether ``rec`` may serve (by name, as the default, behind a new alias): its verdict passed
    (or there is no guard), or it was forced and its verdict is known. Nothing serves while it
    is evaluating."""
    if rec.guard_status == GuardStatus.EVALUATING:
        return False
    return rec.forced or rec.guard_status in SERVABLE


def check_manifest_guard(guard: dict[str, Any] | None, force: bool) -> None:
    """The manifest's self-reported guard: a recorded failure refuses unless ``force``; a pass
    proves nothing (anyone can write it) and decides nothing when the server has sentinels."""
    if force:
        if isinstance(guard, dict) and guard.get("passed") is False:
            log.warning("manifest guard failure overridden by force")
        return
    check_guard(guard)


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

    @classmethod
    def from_manifest(cls, m: EncoderManifest, source: str) -> "EncoderRecord":
        return cls(key=m.key, name=m.name, version=m.version, kind=m.kind,
                   space=str(m.space.get("fingerprint") or m.embedding_space().fingerprint),
                   files=dict(m.files), registered_at=time.time(), source=source,
                   created_at=m.created_at, training=m.training, guard=m.guard)


class EncoderRegistry:
    """See the module docstring. Blocking methods (``register``, ``delete``, ``set_alias``,
    ``ensure_loaded``) must run off the event loop; ``acquire``/``release``/lookups are cheap."""

    def __init__(self, *, state_dir: Path, pool: EncoderPool, space: EmbeddingSpace, backend: Any,
                 default_encoder: str = BASE_KEY, memory_budget: int = 1 << 30, metrics: Any = None,
                 guard: Any = None) -> None:
        self.state_dir = Path(state_dir)
        self.store = self.state_dir / "encoders"
        self.file = self.state_dir / REGISTRY_FILE
        self.pool = pool
        self.space = space
        self.backend = backend
        self.default_ref = default_encoder
        self.memory_budget = memory_budget
        self.metrics = metrics
        self._records: dict[str, EncoderRecord] = {}
        self._aliases: dict[str, str] = {}
        self._refs: dict[str, int] = {}
        self._loaded: OrderedDict[str, int] = OrderedDict()   # key -> bytes, least recently used first
        self._deleting: set[str] = set()
        self._lock = threading.RLock()
        self._load_lock = threading.Lock()
        self._admin_lock = threading.Lock()
        self._state_fd: int | None = None
        self.guard = guard                      # a qswap.server.sentinels.SentinelGuard, or None
        self._jobs: dict[str, Future] = {}
        self._stopping = False

    # -- persistence --------------------------------------------------------------------------

    def load_state(self) -> None:
        """Lock the state dir, read the registry file, drop entries whose stored copy is gone."""
        self.store.mkdir(parents=True, exist_ok=True)
        self._lock_state_dir()
        if self.file.exists():
            try:
                data = json.loads(self.file.read_text())
                records = {k: EncoderRecord(**v) for k, v in data.get("encoders", {}).items()}
                aliases = {str(k): str(v) for k, v in data.get("aliases", {}).items()}
            except (json.JSONDecodeError, TypeError, AttributeError, UnicodeDecodeError) as e:
                raise IntegrityError(f"{self.file} is not a valid registry file: {e}",
                                     "restore it from a backup, or move it away to start with no encoders") from None
        else:
            records, aliases = {}, {}
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
        with self._lock:
            self._records, self._aliases = records, aliases
        if changed:
            self._save(records, aliases)
        self._gauges()

    def _lock_state_dir(self) -> None:
        # Two servers writing one registry file would lose each other's changes.
        if self._state_fd is not None:
            return
        self._state_fd = try_lock_exclusive(self.state_dir / STATE_LOCK_FILE,
                                            f"state dir {self.state_dir} is in use by another server",
                                            "give each server its own --state-dir")

    def close(self) -> None:
        """Release the state-dir lock (the registry file is always up to date)."""
        if self._state_fd is not None:
            os.close(self._state_fd)
            self._state_fd = None

    def _save(self, records: dict[str, EncoderRecord], aliases: dict[str, str]) -> None:
        atomic_write_json(self.file, {"format": FORMAT,
                                      "encoders": {k: asdict(r) for k, r in sorted(records.items())},
                                      "aliases": dict(sorted(aliases.items()))})

    # -- resolution and reference counts ------------------------------------------------------

    def _resolve_ref(self, ref: str) -> str:
        if ref == BASE_KEY:
            return BASE_KEY
        if "@" in ref:
            if ref in self._records and ref not in self._deleting:
                return ref
            raise NotFoundError(f"encoder {ref} is not registered", "list encoders with GET /v1/encoders")
        versions = [r for r in self._records.values() if r.name == ref and r.key not in self._deleting]
        if not versions:
            raise NotFoundError(f"no encoder named {ref!r} is registered",
                                "list encoders with GET /v1/encoders, or register one with POST /v1/encoders")
        # The highest servable version (a newer one still evaluating or refused does not block
        # the name); none servable: the highest, whose guard error the caller then reports.
        # Equal orders (e.g. "1.0" and "1.00") fall back to the latest registered.
        versions.sort(key=lambda r: (version_order(r.version), r.registered_at), reverse=True)
        return next((r.key for r in versions if is_servable(r)), versions[0].key)

    def default_key(self) -> str:
        """The encoder that answers requests naming none: the ``default`` alias, else the
        configured default encoder resolved like a name (its highest servable version)."""
        with self._lock:
            return self._aliases.get(DEFAULT_ALIAS) or self._resolve_ref(self.default_ref)

    def resolve(self, encoder: str | None = None, domain: str | None = None) -> str:
        """Exact key for an encoder name/key, a domain alias, or (neither) the default."""
        with self._lock:   # "not both" is checked by the request model (qswap.server.models)
            if domain is not None:
                key = self._aliases.get(domain)
                if key is None:
                    known = ", ".join(sorted(self._aliases)) or "none"
                    raise NotFoundError(f"no alias for domain {domain!r}", f"known domains: {known}")
                return key
            if encoder is None:
                return self.default_key()
            return self._resolve_ref(encoder)

    def acquire(self, encoder: str | None = None, domain: str | None = None) -> str:
        """Resolve and hold a reference: the key stays registered and loaded until :meth:`release`."""
        with self._lock:
            key = self.resolve(encoder, domain)
            if domain is None and (encoder is not None or DEFAULT_ALIAS not in self._aliases):
                # An alias was checked when it was set; a name and the configured default must
                # pass the guard now.
                self._require_servable(key, force=False)
            self._refs[key] = self._refs.get(key, 0) + 1
            if key in self._loaded:
                self._loaded.move_to_end(key)
            return key

    def _require_servable(self, key: str, force: bool) -> None:
        """Raise unless ``key`` may serve (holds ``_lock``); see :meth:`_guard_error`."""
        rec = self._records.get(key)
        err = self._guard_error(rec, force) if rec is not None else None
        if err is not None:
            raise err

    @staticmethod
    def _guard_error(rec: EncoderRecord, force: bool) -> QswapError | None:
        """Why ``rec`` may not serve, or None (see :func:`is_servable`); ``force`` accepts a
        known verdict (refused, insufficient evidence, failed), never a pending one."""
        key = rec.key
        if rec.guard_status == GuardStatus.EVALUATING:
            return GuardPendingError(f"encoder {key} is still being evaluated on the server's sentinels",
                                     f"retry when GET /v1/encoders/{key} shows guard_status 'passed'")
        if force or is_servable(rec):
            return None
        ev = rec.evaluation or {}
        if rec.guard_status == GuardStatus.FAILED:
            return GuardRefusedError(f"encoder {key} could not be evaluated on the server's sentinels: "
                                     f"{ev.get('error', 'unknown error')}",
                                     "register it again to retry the evaluation, or use force=true", guard=ev)
        if rec.guard_status == GuardStatus.INSUFFICIENT:
            return GuardRefusedError(f"encoder {key} could not be judged: {insufficient_table(ev)}",
                                     "rebuild the sentinels over the current index (`qswap sentinels make "
                                     "--index`) and restart, or use force=true to accept it unjudged", guard=ev)
        return GuardRefusedError(f"encoder {key} significantly degrades sentinel(s): "
                                 f"{guard_table(ev, only_bad=True) or 'see its evaluation'}",
                                 "re-tune it, or use force=true to accept it anyway", guard=ev)

    def _hold(self, key: str) -> None:
        """A reference without any check (the guard's own use of an encoder)."""
        with self._lock:
            self._refs[key] = self._refs.get(key, 0) + 1

    def release(self, key: str) -> None:
        with self._lock:
            n = self._refs.get(key, 0) - 1
            if n > 0:
                self._refs[key] = n
            else:
                self._refs.pop(key, None)

    def in_flight(self, key: str) -> int:
        with self._lock:
            return self._refs.get(key, 0)

    def is_loaded(self, key: str) -> bool:
        with self._lock:
            return key == BASE_KEY or key in self._loaded

    def _pinned(self) -> set[str]:
        pinned = {BASE_KEY, *self._aliases.values()}
        try:
            pinned.add(self.default_key())
        except NotFoundError:
            pass
        return pinned

    # -- loading and the LRU -----------------------------------------------------------------

    def ensure_loaded(self, key: str) -> None:
        """Attach ``key`` to the pool if it is not (blocking: reads and verifies the stored copy)."""
        if self.is_loaded(key):
            return
        with self._load_lock:
            with self._lock:
                if key in self._loaded:
                    return
                if key not in self._records:
                    raise NotFoundError(f"encoder {key} is not registered", "list encoders with GET /v1/encoders")
            with intake.server_paths_hidden({self.state_dir: "<state-dir>"}):
                art = load_encoder(self.store / key, self.space)   # re-verifies checksums of the stored copy
            self.pool.add(art)
            # Prepared before it is counted: what the backend holds for it depends on how it is
            # served (the shared runtime binds a LoRA adapter in place: 0 bytes; a merged export
            # holds a whole transformer), and the budget must count the first, not the second.
            self._prepare(key)
            with self._lock:
                self._loaded[key] = self._footprint(key)
            if self.metrics is not None:
                self.metrics.loads.inc()
            log.info("encoder loaded", extra={"encoder": key, "bytes": self._loaded.get(key)})
            self._evict(keep=key)
        self._gauges()

    def _footprint(self, key: str) -> int:
        """What a loaded encoder costs the budget: its pool bytes plus the backend's copy (an
        ONNX session holds the whole transformer, ~8x a LoRA adapter for e5-small)."""
        return self.pool.memory_bytes(key) + self.backend.memory_bytes(key)

    def _evict(self, keep: str) -> None:
        """Detach least recently used, unpinned, idle encoders until under budget (holds _load_lock)."""
        while True:
            with self._lock:
                if sum(self._loaded.values()) <= self.memory_budget:
                    return
                pinned = self._pinned()
                victim = next((k for k in self._loaded
                               if k != keep and k not in pinned and not self._refs.get(k)), None)
                if victim is None:
                    log.warning("loaded encoders exceed the memory budget; nothing can be evicted",
                                extra={"bytes": sum(self._loaded.values()), "budget": self.memory_budget})
                    return
                del self._loaded[victim]   # from now on a new request reloads it (after this lock)
            self.pool.remove(victim)
            self._discard(victim)   # an ONNX session would keep the memory the budget freed
            if self.metrics is not None:
                self.metrics.evictions.inc()
            log.info("encoder evicted", extra={"encoder": victim})

    def _prepare(self, key: str) -> None:
        try:
            self.backend.prepare(key)
        except Exception:   # an export failure must not fail the request: the pool still serves
            log.exception("backend prepare failed", extra={"encoder": key})

    def _discard(self, key: str) -> None:
        try:
            self.backend.discard(key)
        except Exception:
            log.exception("backend discard failed", extra={"encoder": key})

    def _gauges(self) -> None:
        if self.metrics is None:
            return
        with self._lock:
            self.metrics.encoders_loaded.set(len(self._loaded) + 1)
            self.metrics.encoders_loaded_bytes.set(sum(self._loaded.values()))
            self.metrics.encoders_registered.set(len(self._records))

    # -- administration ------------------------------------------------------------------------

    def register(self, src: Path | EncoderDir, *, force: bool = False, source: str = "",
                 wait: bool = False) -> tuple[EncoderRecord, bool]:
        """Copy, verify and attach the encoder directory ``src``; returns (record, created).

        ``src`` is a directory held open (:func:`qswap.server.intake.open_under_root`: what was
        checked is what is copied) or a path the server trusts (opened here, no link followed).

        With sentinels the record comes back ``evaluating`` while the server's evaluation runs
        in the background, unless ``wait``: then this returns once the verdict is in, and a
        refused (or failed) encoder is unregistered again and raises :class:`GuardRefusedError`
        carrying the table, so a refused request changes nothing.
        """
        try:
            if isinstance(src, EncoderDir):
                rec, created, job = self._register(src, force, source)
            else:
                with intake.open_dir(Path(src)) as opened:
                    rec, created, job = self._register(opened, force, source)
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
            rec = self._records.get(key)
        if rec is None:
            raise NotFoundError(f"encoder {key} was deleted during its evaluation", "register it again")
        err = self._guard_error(rec, force=False)
        if err is not None:
            if drop:
                self._unregister_unserved(key)
            raise err
        return rec

    def _register(self, src: EncoderDir, force: bool, source: str) -> tuple[EncoderRecord, bool, Future | None]:
        with self._admin_lock:
            self.store.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=_INCOMING, dir=self.store))
            try:
                with intake.server_paths_hidden({staging: src.label, self.state_dir: "<state-dir>"}):
                    art = self._copy_and_verify(src, staging)
                manifest = art.manifest
                validate_name(manifest.name)
                validate_name(manifest.version, "encoder version")
                key = manifest.key
                if manifest.name.lower() in (BASE_KEY, DEFAULT_ALIAS):   # "BASE" would read as the base
                    raise ConflictError(f"encoder name {manifest.name!r} is reserved (in any case)",
                                        "rename the encoder")
                with self._lock:
                    existing = self._records.get(key)
                if existing is not None:
                    if existing.files == manifest.files and existing.kind == manifest.kind:
                        return self._register_again(existing, force)
                    raise ConflictError(f"encoder {key} is already registered with different files",
                                        "register the new files under a new version")
                check_manifest_guard(manifest.guard, force)
                rec = EncoderRecord.from_manifest(manifest, source)
                rec.forced = force
                rec.guard_status = GuardStatus.EVALUATING if self.guard is not None else GuardStatus.UNGUARDED
                target = self.store / key
                with self._load_lock:
                    self.pool.add(art)   # refuses an adapter that does not fit the base
                    try:
                        if target.exists():
                            shutil.rmtree(target)   # an unregistered leftover
                        os.replace(staging, target)
                        with self._lock:
                            records = {**self._records, key: rec}
                            aliases = dict(self._aliases)
                        self._save(records, aliases)
                    except BaseException:
                        self.pool.remove(key)
                        shutil.rmtree(target, ignore_errors=True)
                        raise
                    self._prepare(key)   # before counting it and before the guard encodes with it
                    with self._lock:
                        self._records = records
                        self._loaded[key] = self._footprint(key)
                    if self.metrics is not None:
                        self.metrics.loads.inc()
                    self._evict(keep=key)
                job = self._schedule(key) if self.guard is not None else None
            finally:
                if staging.exists():
                    shutil.rmtree(staging, ignore_errors=True)
        log.info("encoder registered", extra={"encoder": key, "kind": rec.kind, "source": source,
                                              "guard_status": rec.guard_status, "forced": force})
        return rec, True, job

    def _copy_and_verify(self, src: EncoderDir, staging: Path) -> Any:
        """Copy ``src`` into ``staging`` and load the copy (manifest, checksums, then the space):
        everything after this reads the copy, so what is verified is what is stored and served."""
        intake.copy_encoder(src, staging)
        return load_encoder(staging, self.space)

    def _register_again(self, existing: EncoderRecord, force: bool) -> tuple[EncoderRecord, bool, Future | None]:
        """The identical encoder is registered already (holds ``_admin_lock``): ``force`` accepts
        a refused verdict; a failed evaluation is retried; a pending one is returned with its job."""
        key = existing.key
        if force and not existing.forced and existing.guard_status not in SERVABLE:
            existing = self._update_record(key, forced=True)   # serves once its verdict is known
        if existing.guard_status == GuardStatus.EVALUATING:
            return existing, False, self._jobs.get(key)
        if existing.guard_status == GuardStatus.FAILED and self.guard is not None:
            rec = self._update_record(key, guard_status=GuardStatus.EVALUATING)
            return rec, False, self._schedule(key)
        if not force:
            with self._lock:
                self._require_servable(key, force=False)
        return existing, False, None

    def _update_record(self, key: str, **changes: Any) -> EncoderRecord:
        """Replace fields of a record, file first (caller holds ``_admin_lock``)."""
        with self._lock:
            rec = replace(self._records[key], **changes)
            records = {**self._records, key: rec}
            aliases = dict(self._aliases)
        self._save(records, aliases)
        with self._lock:
            self._records = records
        return rec

    def _unregister_unserved(self, key: str) -> None:
        """Drop an encoder nothing can be serving (refused while its registration waited)."""
        with self._admin_lock:
            with self._lock:
                if key not in self._records or key in self._aliases.values():
                    return
                records = {k: r for k, r in self._records.items() if k != key}
                aliases = dict(self._aliases)
            self._save(records, aliases)
            with self._load_lock:
                with self._lock:
                    self._records = records
                    self._loaded.pop(key, None)
                if key in self.pool:
                    self.pool.remove(key)
            self._discard(key)
            self._forget_guard(key)
            shutil.rmtree(self.store / key, ignore_errors=True)
        log.info("encoder refused by the guard and unregistered", extra={"encoder": key})

    # -- the server's own guard -----------------------------------------------------------------

    def _schedule(self, key: str) -> Future:
        """Queue the sentinel evaluation of ``key`` on the guard thread."""
        assert self.guard is not None
        fut = self.guard.submit(lambda: self._evaluate(key))
        with self._lock:
            self._jobs[key] = fut
        fut.add_done_callback(lambda f: self._jobs.pop(key, None) if self._jobs.get(key) is f else None)
        return fut

    def start_guard(self) -> None:
        """At start: evaluate encoders that have no verdict on these sentinels (registered on a
        server without sentinels, or interrupted). Their existing aliases keep serving."""
        if self.guard is None:
            return
        with self._lock:
            todo = [k for k, r in self._records.items()
                    if r.guard_status in (GuardStatus.UNGUARDED, GuardStatus.EVALUATING, GuardStatus.FAILED)
                    or (r.evaluation or {}).get("sentinels") != self.guard.fingerprint]
        with self._lock:
            warm = [BASE_KEY, *sorted({k for k in self._aliases.values() if k != BASE_KEY})]
            versions = {k: self._records[k].digest if k in self._records else k for k in warm}
        self.guard.submit(lambda: self._warm(warm, versions))
        if self.metrics is not None:
            with self._lock:
                done = [(k, r) for k, r in self._records.items() if k not in todo and r.evaluation]
            for k, r in done:
                self.metrics.export_guard(k, r.evaluation, r.guard_status)
        with self._admin_lock:
            for key in sorted(todo):
                if self._records[key].guard_status in (GuardStatus.UNGUARDED, GuardStatus.FAILED):
                    self._update_record(key, guard_status=GuardStatus.EVALUATING)
                self._schedule(key)
        if todo:
            log.info("guard re-evaluating encoders without a verdict on these sentinels", extra={"encoders": todo})

    def _warm(self, keys: list[str], versions: dict[str, str]) -> None:
        for k in keys:
            self._hold(k)
        try:
            for k in keys:
                self.ensure_loaded(k)
            self.guard.warm(keys, versions)
        except Exception:   # only a head start: the evaluation encodes what is missing
            log.exception("guard warm-up failed")
        finally:
            for k in keys:
                self.release(k)

    def _evaluate(self, key: str) -> None:
        """The guard job: evaluate ``key`` against base and every aliased encoder, store the verdict."""
        assert self.guard is not None
        with self._lock:
            if key not in self._records or key in self._deleting:
                return
            against = [BASE_KEY, *sorted({k for k in self._aliases.values()
                                          if k not in (BASE_KEY, key) and k in self._records})]
            # The verdict is about these files: the cache of query embeddings and the final
            # write both name them, so a re-registration with other files never inherits it.
            versions = {k: self._records[k].digest if k in self._records else k for k in [key, *against]}
        held = [key, *against]
        for k in held:
            self._hold(k)
        t0 = time.perf_counter()
        try:
            for k in held:
                self.ensure_loaded(k)
            record = self.guard.evaluate(key, against, versions)
            status = GuardStatus(record["verdict"])
        except Exception as e:   # fail closed: an evaluation that breaks leaves the encoder unservable
            log.exception("guard evaluation failed", extra={"encoder": key})
            msg = e.message if isinstance(e, QswapError) else f"{type(e).__name__}: {e}"
            record = {"source": "server", "passed": False, "verdict": GuardStatus.FAILED.value, "error": msg,
                      "checks": [], "sentinels": self.guard.fingerprint, "evaluated_at": time.time()}
            status = GuardStatus.FAILED
        finally:
            for k in held:
                self.release(k)
        record["encoder_digest"] = versions[key]
        if not self._store_verdict(key, versions[key], status, record):
            return
        if self.metrics is not None:
            self.metrics.export_guard(key, record, status, time.perf_counter() - t0)
        if status != GuardStatus.PASSED:
            with self._lock:
                aliased = sorted(d for d, k in self._aliases.items() if k == key)
            if aliased:
                log.error("an aliased encoder failed the guard; its aliases keep serving it",
                          extra={"encoder": key, "domains": aliased, "guard_status": status})

    def _store_verdict(self, key: str, digest: str, status: GuardStatus, record: dict[str, Any]) -> bool:
        """Write a verdict onto ``key`` if the record still holds the files it judged; False when
        it was dropped (deleted, re-registered with other files, shutting down)."""
        if self._stopping:
            return False
        with self._admin_lock:
            with self._lock:
                rec = self._records.get(key)
            if rec is None or rec.digest != digest:
                log.warning("guard verdict dropped: the encoder was deleted or replaced during its evaluation",
                            extra={"encoder": key, "guard_status": status})
                return False
            try:
                self._update_record(key, guard_status=status, evaluation=record)
            except Exception:
                log.exception("could not store the guard verdict", extra={"encoder": key})
                return False
        return True

    def stop_guard(self) -> None:
        """At shutdown: queued evaluations are dropped and a running one stores nothing (it
        would fail on the closing index and record a false 'failed'); a restart evaluates again."""
        self._stopping = True
        if self.guard is not None:
            self.guard.close()

    def _forget_guard(self, key: str) -> None:
        if self.guard is not None:
            self.guard.forget(key)
        if self.metrics is not None:
            self.metrics.unexport_guard(key)

    def wait_for_guard(self, key: str, timeout: float | None = None) -> None:
        """Block until ``key``'s pending evaluation (if any) is done (tests and the CLI)."""
        with self._lock:
            job = self._jobs.get(key)
        if job is not None:
            job.result(timeout)

    def delete(self, key: str, timeout_s: float = 30.0) -> None:
        """Unregister ``key`` after its in-flight requests finish (new ones are refused at once)."""
        if "@" not in key:
            raise InvalidInputError(f"delete needs an exact name@version, got {key!r}",
                                    "list the versions with GET /v1/encoders")
        with self._admin_lock:
            with self._lock:
                if key not in self._records:
                    raise NotFoundError(f"encoder {key} is not registered", "list encoders with GET /v1/encoders")
                domains = sorted(d for d, k in self._aliases.items() if k == key)
                if domains:
                    raise ConflictError(f"encoder {key} is the target of aliases {domains}",
                                        "point those aliases elsewhere or delete them first")
                if self._serving_default() == key:
                    raise ConflictError(f"encoder {key} is the default encoder",
                                        "configure another default encoder first")
                self._deleting.add(key)
            try:
                deadline = time.monotonic() + timeout_s
                while self.in_flight(key):
                    if time.monotonic() > deadline:
                        raise ConflictError(f"encoder {key} still has requests in flight after {timeout_s:.0f}s",
                                            "retry the delete when traffic to it has drained")
                    time.sleep(0.005)
                with self._lock:
                    records = {k: r for k, r in self._records.items() if k != key}
                    aliases = dict(self._aliases)
                self._save(records, aliases)
            except BaseException:
                with self._lock:
                    self._deleting.discard(key)
                raise
            with self._load_lock:
                with self._lock:
                    self._loaded.pop(key, None)
                    self._records = records
                    self._deleting.discard(key)
                if key in self.pool:
                    self.pool.remove(key)
            self._discard(key)
            self._forget_guard(key)
            shutil.rmtree(self.store / key, ignore_errors=True)
        log.info("encoder deleted", extra={"encoder": key})
        self._gauges()

    def _serving_default(self) -> str | None:
        """The key requests naming no encoder are served by now, if any (holds ``_lock``): a
        default that may not serve (evaluating, refused) serves nothing, so it can be deleted."""
        try:
            key = self.default_key()
        except NotFoundError:
            return None
        rec = self._records.get(key)
        return key if rec is None or DEFAULT_ALIAS in self._aliases or is_servable(rec) else None

    def set_alias(self, domain: str, ref: str, force: bool = False) -> tuple[str, str | None]:
        """Point ``domain`` at ``ref`` (loaded first, so the switch costs traffic nothing).

        The guard fails closed: an encoder still under evaluation is refused, even with
        ``force``; a refused (insufficient evidence, failed) one only with ``force``, which
        records the encoder as forced (it then serves by name too)."""
        validate_name(domain, "domain")
        if domain.lower() == DEFAULT_ALIAS and domain != DEFAULT_ALIAS:
            raise InvalidInputError(f"domain {domain!r} is a case variant of the reserved alias "
                                    f"{DEFAULT_ALIAS!r}", f"use {DEFAULT_ALIAS!r} or another name")
        with self._admin_lock:
            with self._lock:
                key = self.resolve(encoder=ref)
                self._require_servable(key, force)
                self._refs[key] = self._refs.get(key, 0) + 1   # held so it cannot be evicted before it is pinned
            try:
                rec = self._records.get(key)
                if rec is not None and not is_servable(rec):   # accepted by force: on record
                    self._update_record(key, forced=True)
                self.ensure_loaded(key)
                with self._lock:
                    previous = self._aliases.get(domain)
                    aliases = {**self._aliases, domain: key}
                    records = dict(self._records)
                self._save(records, aliases)
                with self._lock:
                    self._aliases = aliases   # one reference swap: requests see old or new
            finally:
                self.release(key)
        log.info("alias set", extra={"domain": domain, "encoder": key, "previous": previous})
        return key, previous

    def delete_alias(self, domain: str) -> str:
        with self._admin_lock:
            with self._lock:
                if domain not in self._aliases:
                    raise NotFoundError(f"no alias for domain {domain!r}", "list aliases with GET /v1/aliases")
                key = self._aliases[domain]
                aliases = {d: k for d, k in self._aliases.items() if d != domain}
                records = dict(self._records)
            self._save(records, aliases)
            with self._lock:
                self._aliases = aliases
        log.info("alias deleted", extra={"domain": domain, "encoder": key})
        return key

    # -- views ---------------------------------------------------------------------------------

    def aliases(self) -> dict[str, str]:
        with self._lock:
            return dict(self._aliases)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._records)

    def info(self, key: str, base_version: str) -> dict[str, Any]:
        """A JSON-able description of one encoder (``base`` included)."""
        with self._lock:
            pinned = self._pinned()
            aliases = sorted(d for d, k in self._aliases.items() if k == key)
            if key == BASE_KEY:
                return {"key": BASE_KEY, "name": BASE_KEY, "version": base_version, "kind": "identity",
                        "space": self.space.fingerprint, "loaded": True, "pinned": True,
                        "in_flight": self._refs.get(key, 0), "memory_bytes": 0, "aliases": aliases,
                        "source": "base model"}
            rec = self._records.get(key)
            if rec is None:
                raise NotFoundError(f"encoder {key} is not registered", "list encoders with GET /v1/encoders")
            return {**asdict(rec), "loaded": key in self._loaded, "pinned": key in pinned,
                    "in_flight": self._refs.get(key, 0), "memory_bytes": self._loaded.get(key),
                    "aliases": aliases}

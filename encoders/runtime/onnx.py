"""ONNX Runtime backend for query encoders: the fast path of a search's query embedding.

Each encoder of an :class:`~qswap.encoders.pool.EncoderPool` (base + adapter, merged) is
exported once to ONNX (:mod:`qswap.encoders.runtime.onnx_export`) in a background thread and then
served by an ONNX Runtime session; until its export is ready, or if it fails, its rows go
through the pool's torch path, so answers never wait on an export. Same tokenizer, prefix,
pooling and normalisation as the torch path; fp32 graphs agree with torch to cosine
>= 0.99999 (checked at export time on probe texts, and by the tests).

The word-embedding lookup runs here in numpy from the ONE base matrix (zero-copy view of
the torch parameter on CPU), so every exported encoder holds only its transformer weights.

Cache layout (one directory per encoder version and base space)::

    cache_dir/<name@version>/<space fingerprint>/model.onnx
                                                /export.json        # written last: digest, facts
                                                /word_embeddings.npy  # only if the adapter owns one

``export.json`` records a digest of the adapter's tensors; a cached export is reused only if
it matches, so a re-registered key with other weights is re-exported, never served stale.

Use from the server::

    backend = OnnxBackend(pool, cache_dir)
    pool.add(artifact); backend.prepare(artifact.key)   # returns at once
    vecs = backend.encode(texts, keys)                   # ORT for ready keys, torch for the rest
    pool.remove(key); backend.discard(key)
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qswap.encoders.runtime.export_digest import EMBEDDINGS_FILE, EXPORT_FORMAT, MODEL_FILE, encoder_digest
from qswap.encoders.embedding import pad_id, padded_splits
from qswap.encoders.runtime.packing import graph_inputs, packable
from qswap.encoders.runtime.export_cache import cached_dir
from qswap.encoders.runtime.protocol import EncodeFlagged
from qswap.errors import InvalidInputError, NotFoundError

if TYPE_CHECKING:   # the exporter and the pool (torch) are imported where an export is made
    from qswap.encoders.pool import EncoderPool

log = logging.getLogger(__name__)
#: What one more ONNX Runtime call costs, in tokens of forward compute: a batch's rows (longest
#: first) are cut into calls where the padding saved outweighs it (encoders.embedding.padded_splits).
CALL_TOKENS = 16


@dataclass
class _Session:
    session: Any                  # onnxruntime.InferenceSession
    table: np.ndarray             # word-embedding matrix rows are gathered from
    directory: Path
    first_position: int | None = None   # a packed graph's position id of a row's first token; None: padded


def available_providers() -> list[str]:
    """ONNX Runtime execution providers to use: CUDA first where onnxruntime-gpu sees a GPU."""
    import onnxruntime as ort

    have = ort.get_available_providers()
    return (["CUDAExecutionProvider"] if "CUDAExecutionProvider" in have else []) + ["CPUExecutionProvider"]


def make_session(path: Path, threads: int, providers: list[str], spin: bool = True) -> Any:
    """An ONNX Runtime session with full graph optimisation and ``threads`` intra-op threads.

    ``spin``: worker threads busy-wait for work (ONNX Runtime's default). A forward is many
    small parallel sections; waking sleeping workers for each one made a 16-token e5-small
    query 4.8 -> 8.8 ms on 2 threads (no better than 1 thread). Turn it off only where idle
    cores must go to other work.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3   # warnings about CPU fallbacks of a few shape ops are noise
    # Per-session pools: ONNX Runtime's process-wide pool would force every other session in
    # the process (anyone's) to opt in, or fail to load.
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    # Spin inside a forward, stop when it returns: otherwise one session's idle workers keep
    # spinning while the next encoder's session runs, and rotating 4 sessions of e5-small took
    # a 16-token query from 7.0 to 27.2 ms on 2 cores (6.9 ms with this; one session: 6.8 ms).
    so.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(str(path), so, providers=providers)


class OnnxBackend:
    """ONNX Runtime sessions for the encoders of one :class:`EncoderPool`; thread-safe.

    ``threads``: intra-op threads per forward (default: all cores). ``providers``: ONNX
    Runtime execution providers (default :func:`available_providers`). ``fuse``: apply ONNX
    Runtime's transformer fusions when exporting (attention, skip layer norm, bias GELU).
    ``spin``: busy-waiting worker threads (see :func:`make_session`). ``batch_size``: rows
    per ONNX Runtime call.

    ``encode(..., single=True)`` runs an encoder's rows on one core, for a caller that runs
    another forward beside it (a server's second forward lane): on a single-threaded twin of
    its session, built in the background at the first such call (the multi-threaded session
    serves meanwhile). Two calls on one two-thread session at once fight over its threads; a
    one-thread twin runs beside the other call undisturbed. The twin holds the graph's weights
    again (ONNX Runtime keeps a copy per session, pre-packed, even when both sessions are given
    the same initializer values).
    """

    encode_flagged: EncodeFlagged | None = None   # the server's tokenizer flags truncation

    def __init__(self, pool: EncoderPool, cache_dir: Path, threads: int | None = None,
                 providers: list[str] | None = None, fuse: bool = True, spin: bool = True,
                 batch_size: int = 64) -> None:
        if threads is not None and threads < 1:
            raise InvalidInputError(f"threads must be >= 1, got {threads}", "omit it to use all cores")
        self.pool = pool
        self.base = pool.base
        self.cache_dir = Path(cache_dir)
        self.threads = threads
        self.providers = list(providers) if providers else available_providers()
        self.fuse = fuse
        self.spin = spin
        self.batch_size = batch_size
        self._variant = "cuda" if "CUDAExecutionProvider" in self.providers else "cpu"
        # On CPU a graph computes a batch's real tokens only (packed_export) where the base allows it
        # (packable); on a GPU, padded rows.
        self._packed = self._variant == "cpu" and packable(self.base.layout)
        self._threads = threads or os.cpu_count() or 1
        # The base matrix every encoder gathers from: a view of the torch parameter on CPU,
        # one host copy when the base lives on a GPU.
        self._table = self.base.word_embeddings().detach().float().cpu().numpy()
        # An exported graph holds every base weight but the word embeddings, in fp32.
        self._session_bytes = self.base.layout.parameters * 4 - self._table.nbytes
        self._sessions: dict[str, _Session] = {}
        self._twins: dict[str, _Session] = {}   # key -> its single-threaded twin (encode single=True)
        self._twin_futures: dict[str, Future[None]] = {}
        self._futures: dict[str, Future[None]] = {}
        self._errors: dict[str, str] = {}
        self._gen: dict[str, int] = {}   # bumped by discard: a finishing stale export is dropped
        self._lock = threading.RLock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qswap-onnx-export")
        self._builds = 0   # exports (or cached loads) started: builds_started
        self._twin_builds = 0   # single-threaded twins started: builds_started

    # -- lifecycle ------------------------------------------------------------------------------

    def directory(self, key: str) -> Path:
        """Cache directory of ``key``'s export for this base space (the packed graph's on CPU: the
        padded one, in the space's own directory, is the document runtime's)."""
        return self.cache_dir / key / (self.base.space.fingerprint + ("-packed" if self._packed else ""))

    def count_rows(self, keys: list[str]) -> None:
        """Every encoder runs merged already: nothing to adapt."""

    def prepare(self, key: str) -> None:
        """Start exporting ``key`` in the background (idempotent; returns at once).

        Raises :class:`NotFoundError` if the pool has no such encoder. A cached export with
        the same digest is loaded instead of re-exported.
        """
        if key not in self.pool:
            raise NotFoundError(f"encoder {key} is not loaded", "add it to the pool before preparing it")
        with self._lock:
            if key in self._sessions or (key in self._futures and not self._futures[key].done()):
                return
            self._errors.pop(key, None)
            gen = self._gen.get(key, 0)
            self._futures[key] = self._executor.submit(self._build, key, gen)
            self._builds += 1

    def ready(self, key: str) -> bool:
        """Whether ``key`` is served by ONNX Runtime now."""
        with self._lock:
            return key in self._sessions

    def wait(self, key: str, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for ``key``'s export; returns :meth:`ready`."""
        with self._lock:
            fut = self._futures.get(key)
        if fut is not None:
            try:
                fut.result(timeout=timeout)
            except Exception:   # a timeout or a failed export: both answer "not ready"
                pass
        return self.ready(key)

    def building(self) -> list[str]:
        """``merged graph`` while any encoder's export (or session) is being built, ``one-core merged
        session`` while a single-threaded twin is (:meth:`encode` ``single``); empty when neither is."""
        with self._lock:
            return ((["merged graph"] if any(not f.done() for f in self._futures.values()) else [])
                    + (["one-core merged session"] if any(not f.done() for f in self._twin_futures.values()) else []))

    def builds_started(self) -> dict[str, int]:
        """Encoder exports (or cached loads) started so far, as ``merged graph``, and their
        single-threaded twins, as ``one-core merged session``."""
        with self._lock:
            started = {"merged graph": self._builds, "one-core merged session": self._twin_builds}
            return {k: n for k, n in started.items() if n}

    def runtime(self, key: str) -> str:
        """``onnx-merged`` once ``key``'s export serves, ``torch`` (the pool) until then."""
        return "onnx-merged" if self.ready(key) else "torch"

    def memory_bytes(self, key: str) -> int:
        """Bytes ``key``'s session holds once ready (its graph's weights), counted from the start
        so that a memory budget covers what the export is about to load; twice that once its
        single-threaded twin is being built or serves."""
        with self._lock:
            twin = key in self._twins or key in self._twin_futures
        return self._session_bytes * (2 if twin else 1)

    def error(self, key: str) -> str | None:
        """Why ``key``'s last export failed (``None`` if it did not)."""
        with self._lock:
            return self._errors.get(key)

    def discard(self, key: str, delete_cache: bool = False) -> None:
        """Stop serving ``key`` from ONNX Runtime (call it when the encoder is removed).

        A running export of ``key`` finishes but is dropped. ``delete_cache`` also removes
        its cached files (keep them when the same version may be registered again).
        """
        with self._lock:
            self._gen[key] = self._gen.get(key, 0) + 1
            self._sessions.pop(key, None)
            self._twins.pop(key, None)
            self._errors.pop(key, None)
            for fut in (self._futures.pop(key, None), self._twin_futures.pop(key, None)):
                if fut is not None:
                    fut.cancel()
        if delete_cache:
            shutil.rmtree(self.cache_dir / key, ignore_errors=True)

    def close(self) -> None:
        """Drop all sessions and stop the export thread (pending exports are cancelled)."""
        with self._lock:
            for key in list(self._sessions) + list(self._futures):
                self._gen[key] = self._gen.get(key, 0) + 1
            self._sessions.clear()
            self._twins.clear()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _build(self, key: str, gen: int) -> None:
        try:
            sess = self._load_or_export(key)
        except Exception as e:   # any failure leaves the key on the torch path, with the reason kept
            log.warning("ONNX export of %s failed; it stays on torch: %s", key, e)
            with self._lock:
                if self._gen.get(key, 0) == gen:
                    self._errors[key] = f"{type(e).__name__}: {e}"
            raise
        with self._lock:
            if self._gen.get(key, 0) == gen and key in self.pool:
                self._sessions[key] = sess

    def _load_or_export(self, key: str) -> _Session:
        from qswap.encoders.runtime.onnx_export import own_tensors

        own = own_tensors(self.base, self.pool.merged_state_dict(key))
        variant = f"{self._variant}-fused" if self.fuse else "plain"
        target = self.directory(key)
        meta = cached_export(self.base, own, target, key, variant,
                             optimize_for=self._variant if self.fuse else None, packed=self._packed)
        table = np.load(target / EMBEDDINGS_FILE, mmap_mode="r") if meta.get("own_word_embeddings") \
            else self._table
        return _Session(make_session(target / MODEL_FILE, self._threads, self.providers, self.spin),
                        table, target, meta.get("first_position") if self._packed else None)

    def _start_twin(self, key: str, s: _Session) -> None:
        """Build ``key``'s single-threaded twin of ``s`` in the background, once (caller holds the lock)."""
        if key in self._twins or key in self._twin_futures:
            return
        gen = self._gen.get(key, 0)

        def build() -> None:
            twin = replace(s, session=make_session(s.directory / MODEL_FILE, 1, self.providers, self.spin))
            with self._lock:
                if self._gen.get(key, 0) == gen and self._sessions.get(key) is s:
                    self._twins[key] = twin
        self._twin_futures[key] = self._executor.submit(build)
        self._twin_builds += 1

    def twin_ready(self, key: str, timeout: float | None = 0) -> bool:
        """Whether ``key``'s single-threaded twin serves (:meth:`encode` ``single``); ``timeout``:
        seconds to wait for it if it is being built."""
        with self._lock:
            fut = self._twin_futures.get(key)
        if fut is not None and timeout != 0:
            try:
                fut.result(timeout=timeout)
            except Exception:   # a timeout or a failed build: not ready (its rows run on the main session)
                pass
        with self._lock:
            return key in self._twins

    # -- encoding -------------------------------------------------------------------------------

    def encode(self, texts: list[str], keys: list[str], encodings: list[Any] | None = None,
               single: bool = False) -> np.ndarray:
        """Encode row ``i`` as a query with encoder ``keys[i]``; (n, dim) float32, input order.

        Rows whose key is ready run in ONNX Runtime, grouped per key; the others go through
        ``pool.encode`` (torch). Unknown keys raise :class:`NotFoundError` like the pool.
        ``encodings``: the texts' tokenizer encodings when the caller has them (not redone).
        ``single``: on one core, on each key's single-threaded twin (see the class docstring;
        on CPU with more than one thread only: elsewhere the session runs them as it is).
        """
        if len(texts) != len(keys):
            raise InvalidInputError(f"{len(texts)} texts but {len(keys)} encoder keys")
        out = np.empty((len(texts), self.base.dim), dtype=np.float32)
        groups: dict[str, list[int]] = {}
        rest: list[int] = []
        twins = single and self._variant == "cpu" and self._threads > 1
        with self._lock:
            sessions = {k: s for k in dict.fromkeys(keys) if (s := self._sessions.get(k)) is not None}
            if twins:
                for k, s in sessions.items():
                    if k in self._twins:
                        sessions[k] = self._twins[k]
                    else:   # its rows run on the main session until the twin is built
                        self._start_twin(k, s)
        for i, k in enumerate(keys):
            if k in sessions:
                groups.setdefault(k, []).append(i)
            else:
                rest.append(i)
        for k, rows in groups.items():
            if k not in self.pool:
                raise NotFoundError(f"encoder {k} is not loaded", "register it or use a loaded encoder")
            out[rows] = self._run(sessions[k], [texts[i] for i in rows],
                                  [encodings[i] for i in rows] if encodings is not None else None)
        if rest:
            out[rest] = self.pool.encode([texts[i] for i in rest], [keys[i] for i in rest],
                                         encodings=[encodings[i] for i in rest] if encodings is not None else None)
        return out

    def encode_ids(self, key: str, rows: list[np.ndarray]) -> np.ndarray:
        """Encode already tokenised queries (each row: its token ids, prefix included, unpadded)
        with ``key``'s ONNX Runtime session; (n, dim) float32 in input order.

        For callers that tokenise each text once and encode it several times (a tuning run).
        Raises :class:`NotFoundError` if ``key`` is not ready (:meth:`wait` for it first).
        """
        with self._lock:
            s = self._sessions.get(key)
        if s is None:
            raise NotFoundError(f"encoder {key} has no ONNX Runtime session", "prepare it and wait until ready")
        return self._run_ids(s, rows)

    def _run(self, s: _Session, texts: list[str], encodings: list[Any] | None = None) -> np.ndarray:
        tok, prefix = self.base.tokenizer, self.base.spec.query_prefix
        encs = encodings if encodings is not None else tok.encode_batch([prefix + t for t in texts])
        # The tokenizer pads every row to the call's longest: keep each row's real tokens.
        return self._run_ids(s, [np.asarray(e.ids[:sum(e.attention_mask)], dtype=np.int64) for e in encs])

    def _run_ids(self, s: _Session, rows: list[np.ndarray]) -> np.ndarray:
        pad = pad_id(self.base.tokenizer)
        out = np.empty((len(rows), self.base.dim), dtype=np.float32)
        # Length-sorted calls, cut where the padding saved outweighs one more call: a long row
        # does not make every short one pay for its padding (a batch of 16 queries of 8 to 30
        # tokens padded to 30 computes ~1.6x its real tokens).
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        packed = s.first_position is not None
        for lo, hi in padded_splits([len(rows[i]) for i in order], self.batch_size, CALL_TOKENS,
                                    self.base.dim if packed else None):
            idx = order[lo:hi]
            width = len(rows[idx[0]])
            ids = np.full((len(idx), width), pad, dtype=np.int64)
            mask = np.zeros((len(idx), width), dtype=np.int64)
            for r, i in enumerate(idx):
                ids[r, :len(rows[i])] = rows[i]
                mask[r, :len(rows[i])] = 1
            feed = graph_inputs(s.table, ids, mask, self.base.spec.pooling, s.first_position)
            out[idx] = s.session.run(None, feed)[0]
        return out


def cached_export(base: Any, own: dict[str, Any], target: Path, key: str, variant: str,
                  optimize_for: str | None, packed: bool = False) -> dict[str, Any]:
    """The export of base + ``own`` in ``target``: reused when its record's digest matches,
    else exported, checked against torch and swapped in atomically.

    Args:
        base: the :class:`~qswap.encoders.base.BaseEncoder`.
        own: the encoder's tensors that differ from the base (``{}`` for the base itself).
        target: cache directory of this encoder version and base space.
        key: encoder key (recorded).
        variant: ``"<provider>-fused"`` or ``"plain"`` (part of the digest).
        optimize_for: ONNX Runtime fusions for ``"cpu"``/``"cuda"``, or ``None``.
        packed: the packed graph (:mod:`qswap.encoders.runtime.packed_export`), not the padded one.

    Returns:
        The export record (``export.json``): digest, probe cosine, fusions, timings.
    """
    if packed:
        from qswap.encoders.runtime.packed_export import PACKED_FORMAT
        variant = f"{variant}-packed{PACKED_FORMAT}"
    digest = encoder_digest(base, own, variant)

    def export(staging: Path) -> dict[str, Any]:
        from qswap.encoders.runtime.onnx_export import export_onnx

        if packed:
            from qswap.encoders.runtime.packed_export import export_packed
            facts = export_packed(base, staging, optimize_for=optimize_for, own=own, model_file=MODEL_FILE)
        else:
            facts = export_onnx(base, own, staging, optimize_for=optimize_for)
        return {"format": EXPORT_FORMAT, "key": key, "digest": digest, "variant": variant,
                "space": base.space.fingerprint, "base": base.name, **facts}

    meta, exported = cached_dir(target, digest, MODEL_FILE, export)
    if exported:
        from qswap.encoders.runtime.onnx_export import release_freed_memory

        release_freed_memory()   # the export's copies of the graph: ~500 MB a server would keep
        log.info("exported %s to ONNX in %.1fs (probe cosine %.7f)", key, meta["export_seconds"],
                 meta["probe_min_cosine"])
    return meta

"""The default query backend: ONE ONNX Runtime session of the base, adapters bound per run.

The base is exported once (:mod:`qswap.encoders.runtime.shared_export`), fused (MultiHeadAttention,
SkipLayerNormalization, BiasGelu), with every adapted layer's LoRA factors and biases as graph inputs. Each
encoder served this way is only its adapter tensors, bound in place
(:func:`qswap.encoders.runtime.shared_adapters.adapter_inputs`): N LoRA encoders cost the base once plus N x
their adapter bytes. On CPU the graph takes float32 factors: a pool's half-precision ones (a server's default)
run from float32 copies kept for the encoders served last
(:class:`qswap.encoders.runtime.shared_run.WideFeeds`), not through a Cast per factor in every run. A batch runs
one ONNX Runtime call per encoder group (rows of one encoder share its inputs), rows bucketed by real token
length, each encoder's inputs bound once (:class:`qswap.encoders.runtime.shared_run.BoundFeed`). A batch of
several encoder groups runs its calls side by side on a second, single-threaded session of the same graph, one
worker per core (:func:`qswap.encoders.runtime.shared_run.spread_groups` says when); that session is built when
the first such batch comes, so a server whose batches never mix encoders does not hold its weights. With
``mix="segments"`` (or ``"auto"`` for batches of small groups) a mixed batch is instead ONE call of a second
graph that takes the LoRA factors of each of its encoders once and routes each row to its own
(:mod:`qswap.encoders.runtime.shared_segments`); a server's forward lane that runs on one core beside a busy
one makes that call on a single-threaded session of the segment graph, built when such a lane first needs it.

Encoders the shared graph cannot express (``partial`` tensors other than biases), and encoders pinned with
:meth:`SharedBackend.pin`, go to a merged per-encoder export (:class:`qswap.encoders.runtime.onnx.OnnxBackend`),
whose bytes count in the memory budget. The few encoders that serve a fair share of a server's rows
(:meth:`SharedBackend.count_rows`; up to ``hot`` of them) are *hot*: each also gets a merged export, built in the
background, and its rows of interactive batches run there, one call per hot encoder of a batch
(:mod:`qswap.encoders.runtime.hot`); when its share of the traffic falls, it goes back to the shared graph and
its session is freed. Until the shared export is ready, or if it fails, every
row runs on the torch pool, so answers never wait on an export.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qswap.encoders.embedding import length_buckets
from qswap.encoders.runtime.hot import DEFAULT_HOT, HOT_WINDOW_ROWS, HotEncoders, hot_share
from qswap.encoders.runtime.onnx import CALL_TOKENS, OnnxBackend, available_providers, make_session
from qswap.encoders.pool import FACTOR_DTYPES, EncoderPool
from qswap.encoders.runtime.packed_export import cached_packed
from qswap.encoders.runtime.packing import graph_inputs, packable
from qswap.encoders.runtime.shared_export import cached_shared, find_slots, ort_input
from qswap.encoders.runtime.shared_segments import SegmentRunner, encode_segments
from qswap.encoders.runtime.shared_run import (WIDE_BYTES, BoundFeed, WideFeed, WideFeeds, await_build, run_calls,
                                               segment_groups)
from qswap.encoders.runtime.shared_adapters import BOUND_BYTES, VALUE_BYTES, adapter_inputs, session_weight_bytes  # noqa: F401 (re-exported)
from qswap.errors import InvalidInputError, NotFoundError

log = logging.getLogger(__name__)
RETRY_MAX_S = 300.0   # the longest wait between two export attempts
SHARED_DIR = "_shared"
#: How a batch that mixes encoders runs: ``groups``, one call per encoder group (side by side on a second,
#: single-threaded session); ``segments``, one call for all its rows of LoRA encoders and the base
#: (:mod:`qswap.encoders.runtime.shared_segments`); ``auto``, segments only for batches of small groups
#: (:func:`qswap.encoders.runtime.shared_run.segment_groups`).
MIXES = ("groups", "segments", "auto")
# "auto": the fastest at every batch shape measured (bench/results/forward_mixed/); what it holds
# beyond the shared session is fixed, not per encoder (docs/serving.md, "Mixed batches").
DEFAULT_MIX = "auto"


class SharedBackend:
    """Query forwards for every encoder of ``pool`` through one shared ONNX Runtime session.

    Same interface as :class:`~qswap.encoders.runtime.backend.TorchBackend`; thread-safe. ``threads``: intra-op
    threads (default: all cores); ``providers``: ONNX Runtime execution providers (default
    :func:`available_providers`: CUDA first where present); ``batch_size``: rows per ONNX Runtime call;
    ``group_workers``: how many encoder groups of one batch run side by side (default: ``threads``; 1 runs them
    one after another; on CPU only); ``mix``: how a batch that mixes encoders runs (:data:`MIXES`); ``hot``:
    merged sessions kept for the encoders with most of the served rows (:meth:`count_rows`; 0: none);
    ``hot_window``: served rows per decision; ``wide_bytes``: on CPU with half-precision factors, the bytes of
    float32 factor copies kept for the encoders served last
    (:class:`qswap.encoders.runtime.shared_run.WideFeeds`).
    """

    name = "shared"

    def __init__(self, pool: EncoderPool, cache_dir: Path, threads: int | None = None,
                 providers: list[str] | None = None, spin: bool = True, batch_size: int = 64,
                 group_workers: int | None = None, retry_s: float | None = None, mix: str = DEFAULT_MIX,
                 hot: int = DEFAULT_HOT, hot_window: int = HOT_WINDOW_ROWS, wide_bytes: int = WIDE_BYTES) -> None:
        if threads is not None and threads < 1:
            raise InvalidInputError(f"threads must be >= 1, got {threads}", "omit it to use all cores")
        if mix not in MIXES:
            raise InvalidInputError(f"unknown mix {mix!r}", f"use one of {', '.join(MIXES)}")
        self.mix = mix
        self.pool = pool
        self.base = pool.base
        self.cache_dir = Path(cache_dir)
        self.providers = list(providers) if providers else available_providers()
        self.batch_size = batch_size
        self.spin = spin
        self._threads = threads or os.cpu_count() or 1
        # A GPU runs one call at a time anyway: groups side by side only pay on CPU cores.
        self._group_workers = 1 if "CUDAExecutionProvider" in self.providers else (group_workers or self._threads)
        self._variant = "cuda" if "CUDAExecutionProvider" in self.providers else "cpu"
        # On CPU the graph computes a batch's real tokens only (packed_export); on a GPU, padded rows.
        self._packed = self._variant == "cpu" and packable(self.base.layout)
        self._graph: Path | None = None       # the exported graph the sessions run, once loaded
        self._first_position = 0              # the packed graph's position id of a row's first token
        # Read from the checkpoint, not through the torch module (built only when something needs it).
        self._table = self.base.word_embeddings().detach().float().cpu().numpy()
        self.slots = find_slots(self.base.layout)
        self.factors = pool.factor_dtype
        # On CPU the graph takes float32 factors whatever the pool stores (half-precision ones run from
        # float32 copies, WideFeed); on a GPU they go to the device as stored (half the copy).
        self._wide = WideFeeds(wide_bytes) if self._variant == "cpu" and self.factors != "float32" else None
        self._graph_factors = "float32" if self._wide is not None else self.factors
        # The base's own biases and rank-0 factors: every input an encoder does not set, shared by all.
        self._base_inputs = self.slots.base_inputs(self.base, FACTOR_DTYPES[self._graph_factors])
        # Their OrtValues, made once and put in every encoder's feed (each encoder's own are made
        # for it): ~100 OrtValues per encoder fewer (~50 KB at LoRA on every Linear).
        self._base_values: dict[str, Any] | None = None
        self._session: Any = None
        self._error: str | None = None
        # key -> its adapter's own inputs until the session exists, then its full feed (bound OrtValues)
        self._inputs: dict[str, dict[str, torch.Tensor] | BoundFeed] = {}
        self._pinned: set[str] = set()
        # Keys whose rows run on their merged session once it is ready (they keep their shared feed meanwhile).
        self._hot = HotEncoders(hot, hot_window)
        self._lock = threading.RLock()
        # A failed export (EMFILE, a full disk) is tried again after retry_s, doubling up to
        # RETRY_MAX_S, instead of leaving every encoder on torch until a restart.
        self._retry_s = retry_s
        self._failures = 0
        self._retry_timer: threading.Timer | None = None
        self._retried = threading.Condition(self._lock)
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qswap-shared-export")
        self._future: Future[None] = self._executor.submit(self._build)
        # Background builds started, by kind (this export and its retries, the sessions below): builds_started
        self._builds: dict[str, int] = {"shared graph": 1}
        # The single-threaded session for encoder groups run side by side, and its workers.
        self._group_session: Any = None
        self._group_future: Future[None] | None = None
        self._workers = ThreadPoolExecutor(max_workers=self._group_workers, thread_name_prefix="qswap-shared-group")
        # The segment graph's session and runner (mix="segments"/"auto"), built at the first mixed batch.
        self._segments: tuple[Any, SegmentRunner] | None = None
        self._segments_future: Future[None] | None = None
        self._segments_path: Path | None = None
        # Its single-threaded session for forward lanes on one core, built at the first mixed batch of small
        # groups such a lane gets (:meth:`encode_flagged_single`), and its runners: one per lane running on it
        # at once (each with its own buffers), made as lanes need them and kept free between their calls.
        self._segments_single: Any = None
        self._segments_single_future: Future[None] | None = None
        self._single_runners: list[SegmentRunner] = []
        self._single_free: list[SegmentRunner] = []
        # Merged per-encoder exports: encoders the shared graph cannot express, and pinned ones.
        self.merged = OnnxBackend(pool, cache_dir, threads=threads, providers=self.providers, spin=spin,
                                  batch_size=batch_size)

    # -- lifecycle ------------------------------------------------------------------------------

    def directory(self) -> Path:
        return self.cache_dir / SHARED_DIR / self.base.space.fingerprint

    def _build(self) -> None:
        try:
            sess = self._load_or_export()
        except Exception as e:   # any failure leaves every encoder on torch, with the reason kept
            with self._lock:
                self._error = f"{type(e).__name__}: {e}"
                self._failures += 1
                delay = self._schedule_retry()
            log.warning("shared ONNX export failed; encoders stay on torch%s: %s",
                        f" (retry in {delay:.0f}s)" if delay is not None else "", e)
            raise
        with self._lock:
            self._error = None
            self._session = sess
            for key, arrays in list(self._inputs.items()):
                if not isinstance(arrays, BoundFeed):
                    self._inputs[key] = self._feed(arrays)

    def _schedule_retry(self) -> float | None:
        """Start the timer of the next export attempt (holds the lock); its delay, or None."""
        if self._retry_s is None or self._closed:
            return None
        delay = min(self._retry_s * 2 ** (self._failures - 1), RETRY_MAX_S)
        self._retry_timer = threading.Timer(delay, self._retry)
        self._retry_timer.daemon = True
        self._retry_timer.start()
        return delay

    def _retry(self) -> None:
        with self._lock:
            self._retry_timer = None
            if self._closed:
                return
            try:
                self._future = self._executor.submit(self._build)
            except RuntimeError:   # shut down meanwhile
                return
            self._count_build("shared graph")
            self._retried.notify_all()

    def _load_or_export(self, segments: bool = False) -> Any:
        # The segment graph takes the pool's type (its Cast per factor measured cheaper overall than
        # converting as the runner copies: a call whose encoders all change, bench/results/forward_mixed/).
        factors = self.factors if segments else self._graph_factors
        if self._packed:   # the segment graph packed too: tokens, not rows, routed to their encoder
            path, self._first_position = cached_packed(self.base, self.directory(), self._variant, segments, factors)
        else:
            path = cached_shared(self.base, self.directory(), self._variant, factors, segments=segments)
        if segments:
            self._segments_path = path
        else:
            self._graph = path
        return make_session(path, self._threads, self.providers, self.spin)

    def _start_segments(self) -> None:
        """Export (or load) the segment graph and build its session and runner in the background, once: only
        when a batch mixes encoders, so a server whose batches never do holds neither. Until it is ready, or if
        it fails, mixed batches run per group."""
        with self._lock:
            if self._segments_future is not None:
                return

            def build() -> None:
                try:
                    sess = self._load_or_export(segments=True)
                except Exception as e:   # mixed batches keep running per group
                    log.warning("segment ONNX export failed; mixed batches run one call per encoder: %s", e)
                    raise
                runner = SegmentRunner(self.slots, self._base_inputs, FACTOR_DTYPES[self.factors], self._packed)
                with self._lock:
                    self._segments = (sess, runner)
            self._segments_future = self._executor.submit(build)
            self._count_build("segment graph")

    def _start_segments_single(self) -> None:
        """Build the segment graph's single-threaded session in the background, once, after the segment graph
        itself (started here if it is not); its runners are made as lanes need them (:meth:`_single_runner`).

        Why: a forward lane that starts beside a busy one runs on one core. Without this session, its batch of
        small encoder groups ran one single-threaded call per group in turn (a 6-row batch of 8 LoRA domains:
        five calls of one or two rows); the multi-threaded segment session would fight the other lane for its
        threads, and its runner serves one call at a time. Its own runner keeps its own buffers (the factors of
        the encoders of its last call), and two lanes on one core each (the usual case under load: each starts
        while the other encodes) take a runner each, so the lanes never wait on each other. It costs the segment
        graph's weights again (ONNX Runtime pre-packs each session's own), like the mixed-batch session.
        """
        with self._lock:
            if self._segments_single_future is not None:
                return
            path = self._segments_path
            if path is None:   # the segment graph first: its build gives the path
                if self._segments_future is None:
                    self._start_segments()
                return

            def build() -> None:
                sess = make_session(path, 1, self.providers, self.spin)
                with self._lock:
                    if not self._closed:
                        self._segments_single = sess
            self._segments_single_future = self._executor.submit(build)
            self._count_build("one-core segment session")

    def _single_runner(self) -> SegmentRunner:
        """A runner of the one-core segment session that no lane is using (a new one if every one is)."""
        with self._lock:
            if self._single_free:
                return self._single_free.pop()
            runner = SegmentRunner(self.slots, self._base_inputs, FACTOR_DTYPES[self.factors], self._packed)
            self._single_runners.append(runner)
            return runner

    def _runners(self) -> list[SegmentRunner]:
        """The segment runners made (caller holds the lock): each holds copies of encoders' factors."""
        return ([self._segments[1]] if self._segments is not None else []) + list(self._single_runners)

    def _feed(self, own: dict[str, torch.Tensor]) -> BoundFeed:
        """An encoder's full feed, pre-built OrtValues bound once per session: a run copies
        nothing of the adapter (zero-copy on CPU) and passes none of its inputs again. The base's
        inputs the encoder does not set are the values every feed shares (caller holds the lock)."""
        cuda = "CUDAExecutionProvider" in self.providers
        if self._base_values is None:
            self._base_values = {n: ort_input(t, cuda=cuda) for n, t in self._base_inputs.items()}
        if self._wide is not None and any(t.dtype != torch.float32 for t in own.values()):
            return WideFeed(own, self._base_values, self._wide)
        return BoundFeed({**self._base_values, **{n: ort_input(t, cuda=cuda) for n, t in own.items()}})

    def _start_group_session(self) -> None:
        """Build the single-threaded session for side-by-side groups in the background, once.

        A second session because ONNX Runtime's intra-op threads are a session setting: two runs at once on the
        multi-threaded session fight over its threads (8 one-row calls: 118 ms side by side vs 104 ms in turn),
        while single-threaded runs side by side took 84 ms. It costs the shared session's weights again (~85 MB
        for multilingual-e5-small: ONNX Runtime pre-packs each session's weights), hence built only when a batch
        mixes encoders.
        """
        with self._lock:
            if self._group_future is not None or self._group_workers < 2:
                return
            path = self._graph

            def build() -> None:
                sess = make_session(path, 1, self.providers, self.spin)
                with self._lock:
                    self._group_session = sess
            self._group_future = self._executor.submit(build)
            self._count_build("mixed-batch session")

    def prepare(self, key: str) -> None:
        """Convert ``key``'s adapter to graph inputs (or start its merged export); returns at once."""
        if key not in self.pool:
            raise NotFoundError(f"encoder {key} is not loaded", "add it to the pool before preparing it")
        if key in self._pinned:
            self.merged.prepare(key)
            return
        own = adapter_inputs(self.pool, key, self.slots)
        if own is None:
            self.merged.prepare(key)
            return
        with self._lock:
            self._forget(self._inputs.get(key))
            self._inputs[key] = self._feed(own) if self._session is not None else own
            runners = self._runners()
        was_hot = self._hot.discard(key)
        for runner in runners:   # a re-prepared key's factors are copied again when it next runs
            runner.discard(key)
        if was_hot:   # its merged session holds the weights it had: it becomes hot again from its traffic
            self.merged.discard(key)

    def count_rows(self, keys: list[str]) -> None:
        """Count the encoders of rows a server served to its users (not guard or tuning passes); every
        ``hot_window`` rows, decide which encoders are hot (:func:`qswap.encoders.runtime.hot.hot_share`).

        A new hot encoder's merged export starts in the background (cached on disk like any merged export); its
        rows stay on the shared graph until the session is ready. An encoder that is no longer hot goes back to
        the shared graph at once and its session is freed.
        """
        promoted, demoted = self._hot.count(keys, lambda k: k in self._inputs and k in self.pool)
        for k in demoted:
            log.info("encoder %s is no longer hot: back on the shared graph", k)
            self.merged.discard(k)
        for k in promoted:
            log.info("encoder %s is hot (at least %.0f%% of the last %d rows): exporting its merged graph",
                     k, 100 * hot_share(self._hot.slots), self._hot.window)
            try:
                self.merged.prepare(k)
            except NotFoundError:   # removed meanwhile
                self._hot.discard(k)

    def hot(self) -> list[str]:
        """The hot encoders whose rows run merged now (their sessions are ready)."""
        return [k for k in sorted(self._hot.keys()) if self.merged.ready(k)]

    def pin(self, key: str) -> None:
        """Serve ``key`` from its own merged export (for an encoder with most of the traffic);
        its transformer weights count in :meth:`memory_bytes`."""
        with self._lock:
            self._pinned.add(key)
            self._forget(self._inputs.pop(key, None))
            runners = self._runners()
        for runner in runners:
            runner.discard(key)
        self.merged.prepare(key)

    def ready(self, key: str) -> bool:
        with self._lock:
            if key in self._inputs:
                return self._session is not None
        return self.merged.ready(key)

    def wait(self, key: str | None = None, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s for the shared export (and ``key``'s merged one, if it has one); with
        retries on, a failed attempt is followed by the next one while time is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            future = self._future
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                future.result(timeout=left)
                break
            except Exception:   # a timeout or a failed export: both answer "not ready"
                pass
            with self._lock:
                if not future.done() or self._retry_timer is None and self._future is future:
                    break   # timed out, or no retry to come
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self._future is future and not self._retried.wait(left):
                    break
        if key is None:
            return self._session is not None
        with self._lock:
            shared = key in self._inputs
        return self.ready(key) if shared else self.merged.wait(key, timeout)

    def runtime(self, key: str) -> str:
        """``onnx-shared``, ``onnx-merged`` or ``torch``: what runs ``key``'s forwards now."""
        with self._lock:
            shared, session = key in self._inputs, self._session
        if key in self._hot and self.merged.ready(key):
            return "onnx-merged"
        if shared:
            return "onnx-shared" if session is not None else "torch"
        return "onnx-merged" if self.merged.ready(key) else "torch"

    def error(self, key: str) -> str | None:
        with self._lock:
            if key in self._inputs:
                return self._error
        return self.merged.error(key)

    def memory_bytes(self, key: str) -> int:
        """Bytes beyond the pool's: on the shared graph, no tensor data (every input is a pool tensor or a base
        tensor, bound in place) but the objects that bind them (:data:`VALUE_BYTES` per input of its own,
        :data:`BOUND_BYTES` per graph input bound on each session that runs it); or a merged session's weights."""
        with self._lock:
            feed = self._inputs.get(key)
            if feed is not None:
                base = self._base_values or {}
                own = len(feed) if not isinstance(feed, BoundFeed) else \
                    sum(1 for n, v in feed.feed.items() if base.get(n) is not v)
                sessions = 2 if self._group_workers > 1 else 1   # the group session binds it too
                return own * VALUE_BYTES + sessions * (len(self._base_inputs) + 2) * BOUND_BYTES
        return self.merged.memory_bytes(key)

    def shared_bytes(self) -> int:
        """The one shared session's weights (:func:`session_weight_bytes`); the single-threaded session for
        mixed batches, the segment session and its single-threaded twin hold as much again each once built
        (:meth:`groups_side_by_side`, :meth:`segments_ready`, :meth:`segments_single_ready`)."""
        return session_weight_bytes(self.base)

    def groups_side_by_side(self, wait: float | None = 0) -> bool:
        """Whether batches mixing encoders can run their groups side by side now (the
        single-threaded session is built); ``wait``: seconds to wait for it if it is being built."""
        await_build(self._group_future, wait)   # a timeout or a failed build: groups run in turn
        return self._group_session is not None

    def segments_ready(self, wait: float | None = 0) -> bool:
        """Whether batches mixing encoders run as one segment call now (``mix="segments"``, its
        graph built); ``wait``: seconds to wait for it if it is being built."""
        await_build(self._segments_future, wait)   # a timeout or a failed build: mixed batches run per group
        return self._segments is not None

    def segments_single_ready(self, wait: float | None = 0) -> bool:
        """Whether a forward lane on one core runs its batches of small encoder groups as one call of the segment
        graph's single-threaded session now; ``wait``: seconds to wait for it if it is being built."""
        await_build(self._segments_single_future, wait)   # meanwhile, or if it failed: per group, in turn
        return self._segments_single is not None

    def building(self) -> list[str]:
        """What is being built in the background now, by kind: ``shared graph`` (answers run on torch
        meanwhile), ``mixed-batch session``, ``segment graph`` and ``one-core segment session`` (started by the
        first batches that mix encoders; those run per group meanwhile), ``merged graph`` (a hot or pinned
        encoder's; it runs on the shared graph meanwhile). Empty once every build started has finished, whatever
        its outcome (a failure is in :meth:`error` and the log)."""
        with self._lock:
            pending = [("shared graph", self._future), ("mixed-batch session", self._group_future),
                       ("segment graph", self._segments_future),
                       ("one-core segment session", self._segments_single_future)]
        return [name for name, f in pending if f is not None and not f.done()] + self.merged.building()

    def _count_build(self, kind: str) -> None:   # caller holds the lock
        self._builds[kind] = self._builds.get(kind, 0) + 1

    def builds_started(self) -> dict[str, int]:
        """The shared graph's export and its retries, the mixed-batch session, the segment graph and the
        merged exports started so far, by kind (:meth:`building` says which are still running)."""
        with self._lock:
            own = dict(self._builds)
        return {**own, **self.merged.builds_started()}

    def discard(self, key: str) -> None:
        with self._lock:
            self._forget(self._inputs.pop(key, None))
            self._pinned.discard(key)
            runners = self._runners()
        self._hot.discard(key)
        for runner in runners:
            runner.discard(key)
        self.merged.discard(key)

    def _forget(self, entry: Any) -> None:   # a replaced or dropped feed: its float32 copy is freed
        if self._wide is not None and isinstance(entry, WideFeed):
            self._wide.discard(entry)

    def wide_bytes(self) -> int:
        """Bytes of the float32 copies of half-precision factors held now (at most ``wide_bytes``)."""
        return 0 if self._wide is None else self._wide.nbytes()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._retry_timer is not None:
                self._retry_timer.cancel()
                self._retry_timer = None
            self._retried.notify_all()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._workers.shutdown(wait=True)
        self.merged.close()
        with self._lock:
            self._session = None
            self._group_session = None
            self._segments = None
            self._segments_single = None
            self._single_runners, self._single_free = [], []
            self._inputs.clear()

    # -- encoding -------------------------------------------------------------------------------

    def encode(self, texts: list[str], keys: list[str], encodings: list[Any] | None = None) -> np.ndarray:
        """Encode row ``i`` as a query with encoder ``keys[i]``; (n, dim) float32, input order
        (``encodings``: the texts' tokenizer encodings when the caller has them: not redone)."""
        return self.encode_flagged(texts, keys, encodings)[0]

    def encode_flagged_bulk(self, texts: list[str], keys: list[str],
                            encodings: list[Any] | None = None) -> tuple[np.ndarray, list[bool]]:
        """:meth:`encode_flagged` for a server's bulk lane (large requests, on a thread of their
        own beside the interactive one): every call on the single-threaded session, in the
        calling thread, so the bulk work holds one core and none of the interactive session's
        threads (the main session until that session is built)."""
        return self.encode_flagged(texts, keys, encodings, bulk=True)

    def encode_flagged_single(self, texts: list[str], keys: list[str],
                              encodings: list[Any] | None = None) -> tuple[np.ndarray, list[bool]]:
        """:meth:`encode_flagged` on one core, for a server's forward lane that runs beside another one: the
        shared graph's calls as :meth:`encode_flagged_bulk` runs them (but a batch of small encoder groups as one
        call of the segment graph's single-threaded session, built at the first such batch), and the rows of hot
        and merged encoders on their merged sessions' single-threaded twins (:meth:`OnnxBackend.encode`
        ``single``, built at the first such batch), so that a hot encoder's batch runs merged beside the other
        lane instead of on the shared graph or waiting for both cores."""
        return self.encode_flagged(texts, keys, encodings, bulk=True, twin=True)

    def encode_flagged(self, texts: list[str], keys: list[str], encodings: list[Any] | None = None,
                       bulk: bool = False, twin: bool = False) -> tuple[np.ndarray, list[bool]]:
        """:meth:`encode` and, per row, whether the tokenizer cut it at the model's max length, from the one
        tokenisation the forward uses (a server needs both). ``encodings``: the texts' tokenizer encodings when
        the caller has them (not redone); ``bulk``: see :meth:`encode_flagged_bulk`; ``twin`` (with ``bulk``):
        see :meth:`encode_flagged_single`."""
        if len(texts) != len(keys):
            raise InvalidInputError(f"{len(texts)} texts but {len(keys)} encoder keys")
        out = np.empty((len(texts), self.base.dim), dtype=np.float32)
        if not texts:
            return out, []
        encs = encodings if encodings is not None else \
            self.base.tokenizer.encode_batch([self.base.spec.query_prefix + t for t in texts])
        flags = [bool(e.overflowing) for e in encs]
        groups: dict[str, list[int]] = {}
        merged: list[int] = []
        with self._lock:
            session, group_session, segments = self._session, self._group_session, self._segments
            segments_single = self._segments_single
            # The batch's own encoders, looked up: not a copy of every loaded encoder's feed (with
            # hundreds loaded, that copy was the one part of a search that grew with their number).
            feeds = {k: f for k in dict.fromkeys(keys) if isinstance(f := self._inputs.get(k), BoundFeed)} \
                if session is not None else {}
        # The bulk lane holds one core: never a merged session; a forward lane on one core runs the twins.
        hot = self._hot.keys() if not bulk or twin else set()
        for k in hot:
            # Its rows run merged, one call per hot encoder of the batch: with four encoders all hot, as fast
            # as their batch on the shared graph in one segment call, or per group, at 8 and 32 rows
            # (bench/results/forward_mixed_hot/), and faster for a batch of one encoder.
            if self.merged.ready(k):
                feeds.pop(k, None)
        for i, k in enumerate(keys):
            if k in feeds:
                groups.setdefault(k, []).append(i)
            else:
                merged.append(i)
        for k in groups:
            if k not in self.pool:
                raise NotFoundError(f"encoder {k} is not loaded", "register it or use a loaded encoder")
        rows = sum(len(r) for r in groups.values())
        mixed = len(groups) > 1 and (self.mix == "segments" or self.mix == "auto" and segment_groups(rows, len(groups)))
        # The segment session is multi-threaded: a forward lane on one core (twin) runs its single-threaded
        # twin instead. The bulk lane keeps to one call per group: its requests are large, and each has
        # one encoder.
        if mixed and not bulk:
            if segments is not None:
                groups = encode_segments(*segments, groups, self._own, lambda t, e: self._buckets(t, e, self._packed),
                                         self._inputs_of, texts, encs, out)
            else:
                self._start_segments()
        elif mixed and twin:
            if segments_single is not None:
                runner = self._single_runner()
                try:
                    groups = encode_segments(segments_single, runner, groups, self._own,
                                             lambda t, e: self._buckets(t, e, self._packed), self._inputs_of,
                                             texts, encs, out)
                finally:
                    with self._lock:
                        if runner in self._single_runners:   # not closed meanwhile
                            self._single_free.append(runner)
            else:
                self._start_segments_single()
        calls: list[tuple[BoundFeed, list[int], np.ndarray, np.ndarray]] = []   # (feed, rows, ids, mask)
        for k, rows in groups.items():
            for idx, ids, mask in self._buckets([texts[i] for i in rows], [encs[i] for i in rows], self._packed):
                calls.append((feeds[k], [rows[j] for j in idx], ids, mask))
        if (len(groups) > 1 or bulk) and group_session is None:
            self._start_group_session()
        run_calls(calls, self._call, out, session, group_session, self._workers, self._group_workers,
                  groups=len(groups), bulk=bulk)
        if merged:
            out[merged] = self.merged.encode([texts[i] for i in merged], [keys[i] for i in merged],
                                             encodings=[encs[i] for i in merged], single=twin)
        return out, flags

    def _buckets(self, texts: list[str], encs: list[Any], packed: bool = False) -> Any:
        """The calls of ``texts`` (with their encodings): ``(row indices, ids, mask)`` per length bucket;
        ``packed``: cut for the packed graph (only a long row among short ones gets a call of its own)."""
        return length_buckets(self.base.tokenizer, texts, self.base.spec.query_prefix, self.batch_size,
                              encodings=encs, call_tokens=CALL_TOKENS,
                              attention_dim=self.base.dim if packed else None)

    def _own(self, key: str) -> dict[str, torch.Tensor]:
        if (own := adapter_inputs(self.pool, key, self.slots)) is None:   # not for a key with a shared feed
            raise InvalidInputError(f"encoder {key} cannot run on the shared graph")
        return own

    def _call(self, session: Any, feed: BoundFeed, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """One ONNX Runtime call: the rows' word embeddings gathered here, the adapter bound."""
        return feed.run(session, self._inputs_of(ids, mask))

    def _inputs_of(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        """The graph's run-time inputs for padded ``ids`` / ``mask``: packed on the packed graph."""
        return graph_inputs(self._table, ids, mask, self.base.spec.pooling,
                            self._first_position if self._packed else None)

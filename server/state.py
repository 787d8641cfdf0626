"""Everything one running server holds: settings, model, index, encoders, batcher, metrics.

Loading (base model, index -- the demo index is built on first start --, registry, default
encoder) runs in a background thread started by the app's lifespan, so ``/healthz`` answers at
once and ``/readyz`` turns 200 when everything is in place.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from qswap.encoders import BASE_KEY, BaseEncoder, EncoderPool, load_base
from qswap.encoders.embedding import token_lengths
from qswap.errors import NotReadyError, QswapError
from qswap.server.registry.intake import extract_encoder_archive
from qswap.encoders.runtime.backend import make_backend
from qswap.encoders.runtime.protocol import Backend, served, served_single
from qswap.server.serving.batching import MicroBatcher
from qswap.server.config import ServerSettings
from qswap.server.serving.jobs import DocumentJobs
from qswap.server.traffic.abandoned import AbandonedWork
from qswap.server.http.metrics import Metrics
from qswap.server.registry.facade import EncoderRegistry
from qswap.server.registry.records import EncoderRecord
from qswap.server.http.rendering import ResponseLimits

log = logging.getLogger("qswap.server")

#: How long a start without the torch base waits for the base's ONNX session before it is ready
#: (a cached one loads in about a second; an export that is not cached builds the model anyway).
BASE_SESSION_WAIT_S = 60.0


def load_served_base(s: ServerSettings) -> BaseEncoder:
    """The base a server (or a Ray encoder replica) serves. The ONNX backends record its layout
    beside their exports and, once recorded, serve without its torch model (built on first need);
    the torch and cuda backends need it at once."""
    cache = s.state_dir / "onnx" if s.backend in ("shared", "onnx") else None
    return load_base(s.model, device=s.device, cache_dir=cache)


def served_runtime(s: ServerSettings, base: BaseEncoder) -> tuple[EncoderPool, Backend]:
    """The encoder pool over ``base`` and the backend that runs it, as ``s`` sets them (the
    factors' storage type, backend, threads, precision, export retry, hot and mixed batches): one
    builder, so that a Ray encoder replica runs what the single-process server runs."""
    pool = EncoderPool(base, factor_dtype=s.lora_factors)
    backend = make_backend(s.backend, pool, s.state_dir / "onnx", s.onnx_threads, s.query_precision,
                           retry_s=s.export_retry_s, spin=s.onnx_spin, hot=s.hot_encoders, mix=s.mixed_batches)
    return pool, backend


def prepare_base(backend: Backend, base: BaseEncoder) -> None:
    """Start the base's runtime; without its torch model, wait (<= :data:`BASE_SESSION_WAIT_S`) for
    its cached ONNX session (a second or so): a search before it would build the torch model only
    to serve until then (seconds)."""
    backend.prepare(BASE_KEY)
    if not base.built:
        backend.wait(BASE_KEY, timeout=BASE_SESSION_WAIT_S)  # type: ignore[attr-defined]

#: Compute threads of the document tower on the bulk lane (``ServerState.document_encoder``).
DOCUMENT_THREADS_BULK = 1


def freeze_loaded_objects() -> None:
    """Move every object alive now (the index's documents, the tokenizer, the registry: about
    half a million) out of the cyclic garbage collector's reach, once, before serving.

    A full collection otherwise walks them all: ~0.3 s with the GIL held on two cores, in which
    the event loop, the tokens stage and the answers stage stop, several times a minute under
    load (the p99 of a closed loop at c=32). What is loaded later is collected as usual; what is
    frozen is still freed by reference counting, only a reference cycle among it is never freed.
    """
    gc.collect()
    gc.freeze()


class ServerState:
    """The live objects behind one app; attributes are ``None`` until :meth:`load` is done."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.ready = False
        self.draining = False
        # Set by ``qswap serve``, whose process this state owns: freeze_loaded_objects() once
        # loaded (a library or a test embedding the app keeps its own collector as it is).
        self.freeze_when_loaded = False
        self.load_error: str | None = None
        self.base: BaseEncoder | None = None
        self._documents: Any = None   # DocumentEncoder, see document_encoder()
        self.index: Any = None
        self.pool: EncoderPool | None = None
        self.backend: Backend | None = None
        self.registry: EncoderRegistry | None = None
        self.batcher: MicroBatcher | None = None
        self.guard: Any = None          # qswap.guard.evaluator.GuardEvaluator with --sentinels
        self.feedback: Any = None       # qswap.feedback.store.FeedbackStore with --feedback-dir
        self.impressions: Any = None    # qswap.server.traffic.impressions.ImpressionSigner, with capture
        self.feedback_admission: Any = None   # qswap.server.traffic.admission.Admission, with capture
        self.feedback_limit: Any = None        # qswap.server.traffic.ratelimit.ClientRateLimit, with capture
        self.experiments: Any = None    # qswap.server.traffic.experiments.Experiments with --feedback-dir
        # Clients that abandoned large requests, and until when their next one is refused (the cost gate's).
        self.abandoned = AbandonedWork()
        self.jobs = DocumentJobs(self)  # document upserts (qswap.server.serving.jobs)
        self._closed = False
        self._close_lock = threading.Lock()
        self._loader: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start_loading(self) -> None:
        self._loader = threading.Thread(target=self._load_logged, name="qswap-loader", daemon=True)
        self._loader.start()

    def _load_logged(self) -> None:
        t0 = time.perf_counter()
        try:
            self.load()
        except QswapError as e:
            self.load_error = str(e)
            log.error("server failed to load", extra={"error": e.message, "hint": e.hint})
        except Exception as e:  # keep the process answering /readyz with the reason
            self.load_error = f"{type(e).__name__}: {e}"
            log.exception("server failed to load")
        else:
            log.info("server ready", extra={"seconds": round(time.perf_counter() - t0, 3),
                                            "default_encoder": self.registry.default_key() if self.registry else None})

    def load(self) -> None:
        """Load base, index, registry and default encoder; start the batch worker (blocking)."""
        s = self.settings
        base = load_served_base(s)
        self.base = base
        index = self.open_index(base)
        self.index = index
        # Queries from this base must be comparable with the index's documents.
        index.space.require_same(base.space, f"base model {base.name} against index")
        self.metrics.index_documents.set(index.count)
        pool, self.backend = served_runtime(s, base)
        self.pool = pool
        self.metrics.runtime_builds.set_function(self.backend.builds_started)
        guard = None
        if s.sentinels is not None:
            from qswap.guard.evaluator import GuardEvaluator
            from qswap.guard.sentinels import load_sentinels
            sentinels = load_sentinels(s.sentinels)
            guard = GuardEvaluator(sentinels, index, self.backend.encode, self.metrics, s.guard_alpha,
                                  s.guard_min_queries)
            guard.check_coverage()
            log.info("sentinels loaded", extra={"sentinels": guard.summary(), "fingerprint": guard.fingerprint})
        self.guard = guard
        registry = self.make_registry(state_dir=s.state_dir, pool=pool, space=index.space, backend=self.backend,
                                      default_encoder=s.default_encoder, memory_budget=s.encoder_memory_bytes,
                                      metrics=self.metrics, guard=guard)
        registry.load_state()   # holds the state-dir lock from here: no other server uses the dir
        self.registry = registry
        prepare_base(self.backend, base)
        registry.ensure_loaded(registry.default_key())
        for domain, key in registry.aliases().items():
            try:
                registry.ensure_loaded(key)
            except QswapError as e:   # the alias still resolves; its requests will get this error
                log.error("aliased encoder failed to load", extra={"domain": domain, "encoder": key,
                                                                   "error": str(e)})
        batcher = self.make_batcher(encode=served(self.backend), search=index.search, tokenize=self.tokenize,
                                    window_s=s.batch_window_ms / 1000.0, max_batch=s.max_batch,
                                    max_pending=s.max_pending, max_pending_per_encoder=s.max_pending_per_encoder,
                                    metrics=self.metrics, count_tokens=self.token_counts,
                                    max_batch_tokens=s.max_batch_tokens, slice_tokens=s.slice_tokens,
                                    encode_documents=lambda texts: self.embed_documents(texts),
                                    bulk=s.bulk_lane,
                                    encode_bulk=getattr(self.backend, "encode_flagged_bulk", None),
                                    lanes=s.forward_lanes, encode_single=served_single(self.backend))
        self.metrics.admitted.set_function(lambda: batcher.pending)
        if s.feedback_dir is not None:
            from qswap.feedback.store import FeedbackStore
            from qswap.server.traffic.admission import Admission
            from qswap.server.traffic.experiments import Experiments
            from qswap.server.traffic.impressions import ImpressionSigner
            from qswap.server.traffic.ratelimit import ClientRateLimit
            self.feedback = FeedbackStore(s.feedback_dir, max_bytes=s.feedback_max_bytes,
                                          max_age_s=s.feedback_max_age_s)
            self.impressions = ImpressionSigner.for_directory(s.feedback_dir, s.feedback_secret)
            self.feedback_admission = Admission("feedback", s.max_pending_feedback)
            self.feedback_limit = ClientRateLimit("feedback", s.feedback_rate)
            self.experiments = Experiments(self.feedback, registry, self.metrics)
            self.metrics.capture_dropped.set_function(lambda: self.feedback.dropped)
            log.info("feedback capture on", extra={"dir": s.feedback_dir.name})
        # Before ready: an encoder re-evaluated at start is 'evaluating' when the first request comes.
        registry.start_guard()
        with self._close_lock:
            if self._closed:
                index.close()
                return
            batcher.start()
            self.batcher = batcher
            if guard is not None:
                # From here on the guard's forward passes are batch-worker jobs (the cost gate),
                # not a second forward pass beside the worker's; see serving/background.py.
                from qswap.server.serving.background import GatedEncode
                guard.encode = GatedEncode(batcher, closing=guard.closing)
            if self.freeze_when_loaded:
                freeze_loaded_objects()
            self.ready = True
            self.metrics.ready.set(1)

    def make_registry(self, **kw: Any) -> EncoderRegistry:
        """The encoder registry (a Ray replica makes one shared with the other replicas)."""
        return EncoderRegistry(**kw)

    def make_batcher(self, **kw: Any) -> MicroBatcher:
        """The batch worker (a Ray replica wraps it to route requests to other replicas)."""
        return MicroBatcher(**kw)

    def open_index(self, base: BaseEncoder) -> Any:
        """The document index this server searches (a Ray replica opens a shared view instead)."""
        s = self.settings
        if s.index is not None:
            from qswap.index.backends import open_index  # a folder (FAISS) or milvus://...
            return open_index(s.index, read_only=s.read_only_index)
        from qswap.server.demo import open_demo_index
        return open_demo_index(base)

    async def prepare_encoder(self, key: str) -> None:
        """Make ``key`` ready to encode before a search is queued (first use after start or
        eviction). A Ray replica leaves this to the replica its request is routed to."""
        assert self.registry is not None
        if not self.registry.is_loaded(key):
            await asyncio.to_thread(self.registry.ensure_loaded, key)

    def begin_drain(self) -> None:
        """Stop admitting requests (SIGTERM): new ones get 503, admitted ones finish; guard
        evaluations are cancelled (a restart evaluates again)."""
        self.draining = True
        if self.batcher is not None:
            self.batcher.drain()
        if self.registry is not None:
            self.registry.stop_guard()
        log.info("draining: no new requests are admitted")

    def abort_in_flight(self) -> int:
        """End of the drain: every admitted request still waiting or running is answered 503
        now (event loop side). Returns how many."""
        if self.batcher is None:
            return 0
        n = self.batcher.abort(lambda: NotReadyError(
            "the server is shutting down and this request could not finish in time",
            "retry against another instance (a document change may or may not have been made; upserts "
            "and deletes are idempotent)"))
        if n:
            log.warning("drain bound reached: in-flight requests answered 503", extra={"requests": n})
        return n

    def close(self) -> None:
        """Stop the worker (in-flight batch finishes) and release the index."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self.ready = False
            self.metrics.ready.set(0)
        if self.registry is not None:
            self.registry.stop_guard()
        if self.batcher is not None:
            self.batcher.stop()
        if self.backend is not None:
            try:
                self.backend.close()
            except Exception:
                log.exception("closing the backend failed")
        if self._loader is not None and self._loader.is_alive():
            self._loader.join(timeout=0.1)
        if self.registry is not None:
            self.registry.close()
        if self.feedback_admission is not None:
            self.feedback_admission.close()
        if self.feedback is not None:
            self.feedback.close()
        if self.index is not None:
            try:
                self.index.close()
            except Exception:
                log.exception("closing the index failed")

    def require_ready(self) -> None:
        if self.draining or self._closed:
            raise NotReadyError("the server is shutting down", "retry against another instance")
        if not self.ready:
            if self.load_error:
                raise NotReadyError("the server failed to load (its log says why)",
                                    "fix the configuration and restart the server")
            raise NotReadyError("the server is still loading (index and default encoder)",
                                "retry shortly; GET /readyz says when it is ready")

    # -- helpers for routes and the worker ---------------------------------------------------

    @property
    def response_limits(self) -> ResponseLimits:
        """What one search answer may hold (from the settings)."""
        s = self.settings
        return ResponseLimits(s.max_hit_text_chars, s.max_hit_metadata_bytes, s.max_response_bytes)

    @property
    def base_version(self) -> str:
        """The version shown for the ``base`` encoder: its space fingerprint."""
        return self.base.space.fingerprint if self.base is not None else ""

    @property
    def max_text_tokens(self) -> int:
        """Tokens the model reads of one text at most (longer ones are cut)."""
        assert self.base is not None
        return int(self.base.tokenizer.truncation["max_length"])

    def tokenize(self, texts: list[str], documents: bool = False) -> list[Any]:
        """The texts as the model reads them: one tokenizer call (prefix and special tokens
        included, cut at its max length). A query's encodings travel with its batch job, so
        the backend encodes them without tokenising again.

        Args:
            texts: queries (or documents), without their prefix.
            documents: with the document prefix instead of the query prefix.

        Returns:
            One ``tokenizers.Encoding`` per text (its ``overflowing`` says it was cut).
        """
        assert self.base is not None
        prefix = self.base.spec.document_prefix if documents else self.base.spec.query_prefix
        return self.base.tokenizer.encode_batch([prefix + t for t in texts])

    def token_counts(self, texts: list[str], documents: bool = False) -> list[int]:
        """Tokens per text as the model sees them (:meth:`tokenize`, padding not counted): what
        a text costs a forward pass."""
        return token_lengths(self.tokenize(texts, documents))

    def register_archive(self, fileobj: BinaryIO, force: bool, filename: str | None,
                         wait: bool = False) -> tuple[EncoderRecord, bool]:
        """Safely extract an uploaded archive straight into the store's staging folder and
        register the encoder in it (blocking)."""
        assert self.registry is not None
        s = self.settings

        def extract(work: Path) -> Path:
            return extract_encoder_archive(fileobj, work, max_bytes=s.max_extracted_bytes,
                                           max_members=s.max_archive_members,
                                           deadline=time.monotonic() + s.upload_timeout_s,
                                           cancelled=lambda: self._closed)

        name = filename or "archive"
        return self.registry.register_extracted(extract, label=f"upload {name}", force=force,
                                                source=f"upload:{name}", wait=wait)

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        """Embed texts with the frozen document tower, as the index's documents are. Worker thread.

        Args:
            texts: document texts.

        Returns:
            float32 vectors, one row per text.
        """
        assert self.base is not None
        return self.document_encoder().encode(texts)

    def upsert_embedded(self, docs: list[Any], emb: np.ndarray) -> tuple[int, int]:
        """Write embedded documents in one index commit; (written, documents now). Worker thread."""
        n = self.index.upsert(docs, emb)
        count = self.index.count
        self.metrics.index_documents.set(count)
        return n, count

    def document_encoder(self) -> Any:
        """The document tower upserts embed with, at the precision of the index's documents
        (so upserts never mix precisions in it); built on the first upsert. Worker thread.

        With the bulk lane, document rows run there, on one thread (:data:`DOCUMENT_THREADS_BULK`):
        the lane holds one core. A multi-threaded session's spinning workers, at the lane's low
        priority, waited for each other on the one core the searches left them (an 850-document
        upsert took minutes beside a busy event loop) and took the second core when it was free."""
        assert self.base is not None
        if self._documents is None:
            from qswap.encoders.runtime.documents import DocumentEncoder
            from qswap.index.manifest import documents_precision
            build = self.index.manifest.get("build", {})
            self._documents = DocumentEncoder(self.base, precision=documents_precision(build),
                                              cache_dir=self.settings.state_dir / "onnx",
                                              threads=DOCUMENT_THREADS_BULK if self.settings.bulk_lane else None)
        return self._documents

    def delete_documents(self, ids: list[str]) -> tuple[int, int]:
        n = self.index.delete(ids)
        count = self.index.count
        self.metrics.index_documents.set(count)
        return n, count

"""Everything one running server holds: settings, model, index, encoders, batcher, metrics.

Loading (base model, index -- the demo index is built on first start --, registry, default
encoder) runs in a background thread started by the app's lifespan, so ``/healthz`` answers at
once and ``/readyz`` turns 200 when everything is in place.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from qswap.encoders import BASE_KEY, BaseModel, EncoderPool, load_base
from qswap.errors import QswapError
from qswap.server.archive import extract_encoder_archive
from qswap.server.backend import Backend, make_backend
from qswap.server.batching import MicroBatcher
from qswap.server.config import ServerSettings
from qswap.server.errors import NotReadyError
from qswap.server.metrics import Metrics
from qswap.server.registry import EncoderRecord, EncoderRegistry

log = logging.getLogger("qswap.server")


class ServerState:
    """The live objects behind one app; attributes are ``None`` until :meth:`load` is done."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.ready = False
        self.load_error: str | None = None
        self.base: BaseModel | None = None
        self.index: Any = None
        self.pool: EncoderPool | None = None
        self.backend: Backend | None = None
        self.registry: EncoderRegistry | None = None
        self.batcher: MicroBatcher | None = None
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
        base = load_base(s.model, device=s.device)
        self.base = base
        if s.index is not None:
            from qswap.index import DocumentIndex
            index = DocumentIndex.open(s.index, read_only=s.read_only_index)
        else:
            from qswap.server.demo import open_demo_index
            index = open_demo_index(base)
        self.index = index
        # Queries from this base must be comparable with the index's documents.
        index.space.require_same(base.space, f"base model {base.name} against index")
        self.metrics.index_documents.set(index.count)
        pool = EncoderPool(base)
        self.pool = pool
        self.backend = make_backend(s.backend, pool, s.state_dir / "onnx", s.onnx_threads,
                                    s.query_precision)
        registry = EncoderRegistry(state_dir=s.state_dir, pool=pool, space=index.space, backend=self.backend,
                                   default_encoder=s.default_encoder, memory_budget=s.encoder_memory_bytes,
                                   metrics=self.metrics)
        registry.load_state()
        self.registry = registry
        self.backend.prepare(BASE_KEY)
        registry.ensure_loaded(registry.default_key())
        for domain, key in registry.aliases().items():
            try:
                registry.ensure_loaded(key)
            except QswapError as e:   # the alias still resolves; its requests will get this error
                log.error("aliased encoder failed to load", extra={"domain": domain, "encoder": key,
                                                                   "error": str(e)})
        batcher = MicroBatcher(encode=self.backend.encode, search=index.search, truncated=self.truncated,
                               encode_flagged=getattr(self.backend, "encode_flagged", None),
                               window_s=s.batch_window_ms / 1000.0, max_batch=s.max_batch, metrics=self.metrics)
        with self._close_lock:
            if self._closed:
                index.close()
                return
            batcher.start()
            self.batcher = batcher
            self.ready = True
            self.metrics.ready.set(1)

    def close(self) -> None:
        """Stop the worker (in-flight batch finishes) and release the index."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self.ready = False
            self.metrics.ready.set(0)
        if self.batcher is not None:
            self.batcher.stop()
        close_backend = getattr(self.backend, "close", None)
        if close_backend is not None:
            try:
                close_backend()
            except Exception:
                log.exception("closing the backend failed")
        if self._loader is not None and self._loader.is_alive():
            self._loader.join(timeout=0.1)
        if self.registry is not None:
            self.registry.close()
        if self.index is not None:
            try:
                self.index.close()
            except Exception:
                log.exception("closing the index failed")

    def require_ready(self) -> None:
        if not self.ready:
            if self.load_error:
                raise NotReadyError(f"the server failed to load: {self.load_error}",
                                    "fix the configuration and restart the server")
            raise NotReadyError("the server is still loading (index and default encoder)",
                                "retry shortly; GET /readyz says when it is ready")

    # -- helpers for routes and the worker ---------------------------------------------------

    @property
    def base_version(self) -> str:
        """The version shown for the ``base`` encoder: its space fingerprint."""
        return self.base.space.fingerprint if self.base is not None else ""

    def truncated(self, texts: list[str]) -> list[bool]:
        """Which queries exceed the model's max tokens (the tokenizer cuts them). Worker thread."""
        assert self.base is not None
        encs = self.base.tokenizer.encode_batch([self.base.spec.query_prefix + t for t in texts])
        return [bool(e.overflowing) for e in encs]

    def register_archive(self, fileobj: BinaryIO, force: bool, filename: str | None) -> tuple[EncoderRecord, bool]:
        """Safely extract an uploaded archive and register the encoder in it (blocking)."""
        assert self.registry is not None
        s = self.settings
        s.state_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".upload-", dir=s.state_dir) as tmp:
            enc_dir = extract_encoder_archive(fileobj, Path(tmp), max_bytes=s.max_extracted_bytes,
                                              max_members=s.max_archive_members)
            return self.registry.register(enc_dir, force=force, source=f"upload:{filename or 'archive'}")

    def embed_and_upsert(self, docs: list[Any]) -> tuple[int, int]:
        """Embed documents with the base document tower and upsert them. Worker thread."""
        assert self.base is not None
        emb = self.base.encode_documents([d.text for d in docs]).astype(np.float32)
        n = self.index.upsert(docs, emb)
        count = self.index.count
        self.metrics.index_documents.set(count)
        return n, count

    def delete_documents(self, ids: list[str]) -> tuple[int, int]:
        n = self.index.delete(ids)
        count = self.index.count
        self.metrics.index_documents.set(count)
        return n, count

"""The document tower: every place that embeds documents calls :class:`DocumentEncoder`.

``qswap index build`` (locally and in each Ray Data actor), ``qswap index add``, the server's
upserts, tuning's document step and ``qswap bench quality`` embed documents here, so one
choice of runtime and precision holds everywhere:

- ``fp32`` (default) runs the base's fused ONNX Runtime graph: the same export, cache and
  probe check as the query path's merged base (:func:`qswap.encoders.runtime.onnx.cached_export`),
  equal to torch to cosine >= 0.99999;
- ``bf16`` runs torch with its Linear layers in bf16 (:mod:`qswap.encoders.runtime.bf16_linear`;
  attention, norms and softmax in fp32): ONNX Runtime has no bf16 matrix product on x86 CPUs,
  torch uses AVX-512-BF16/AMX;
- ``runtime="torch"`` with ``fp32`` is the reference (``encode_texts``'s forward);
- ``runtime="cuda"`` (the default where the base is on a GPU) runs the gathered forward of the
  query path (SDPA attention; fp32, fp16 or bf16) in large batches, one in flight while the next
  is prepared (:mod:`qswap.encoders.runtime.gpu_documents`); on a CPU it is the same code, eager.

Texts are tokenised in windows by a producer thread while the previous window computes, cut
into token-budget batches (:mod:`qswap.encoders.runtime.token_batches`), and put back in input order.
Each precision's measured quality against fp32 (:data:`PRECISION_QUALITY`) is what an index
manifest records (:meth:`DocumentEncoder.record`); documents of different precisions never
mix in one index (``qswap.index`` checks it).

The ONNX runtime needs no torch: a process that embeds only on it, with the base's layout and
export cached (a base loaded with ``cache_dir``, see :func:`qswap.encoders.base.load_base`), never
imports it. The same graph embeds queries (:meth:`DocumentEncoder.encode_queries`), as the
server's base encoder does.

Use::

    enc = DocumentEncoder(base)                    # fp32 on ONNX Runtime, all cores
    vecs = enc.encode(texts, progress=True)        # (n, dim) float32, input order
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from qswap.encoders.base import BaseEncoder
from qswap.encoders.embedding import length_buckets, pad_id, padded_rows, unpadded
from qswap.encoders.runtime.cancel import run_options
from qswap.encoders.runtime.token_batches import DEFAULT_MAX_TOKENS, token_budget_batches
from qswap.errors import InvalidInputError
from qswap.throughput import Throughput

log = logging.getLogger("qswap.encoders")

RUNTIMES = ("onnx", "torch", "cuda")
#: Runtimes :meth:`DocumentEncoder.encode_queries` embeds queries on: the base's ONNX graph, or
#: the torch base (the reference; the cuda runtime's queries run there too).
QUERY_RUNTIMES = ("onnx", "torch")
#: Precisions a user may choose for documents. int8 (ONNX Runtime quantisation, dynamic or
#: selective) is measured by ``qswap bench embed`` and is not offered: it fails the quality bar.
#: fp16 runs on the cuda runtime only.
DOCUMENT_PRECISIONS = ("fp32", "bf16", "fp16")
#: The quality bar a precision must pass against fp32 on real queries (Debian, 4 languages).
QUALITY_BAR = {"min_cosine": 0.9999, "recall_at_10": 0.995}
#: Measured quality of each precision against fp32, recorded in index manifests: bf16 (Linear
#: layers in bf16) on the first 1,500 documents of the 10,000-document Debian benchmark against
#: the torch fp32 index of it, 2,000 queries (500 each in en/de/fr/it): documents stay within
#: cosine 0.99999 of fp32, but recall@10 of the fp32 top-10 is 0.9928, below the bar's 0.995
#: (fp32 on ONNX Runtime against the same reference: 0.9988, its float16 storage). bf16 is
#: therefore marked as failing the bar: a build at bf16 warns and its manifest says so.
PRECISION_QUALITY: dict[str, dict[str, Any]] = {
    "fp32": {"min_cosine": 1.0, "recall_at_10": 1.0, "passes": True},
    "bf16": {"min_cosine": 0.99999, "mean_cosine": 0.999996, "recall_at_10": 0.9928, "passes": False,
             "measured_on": "1,500 Debian documents, 2,000 queries (en/de/fr/it) vs the torch fp32 index"},
    # Not measured yet: ``qswap bench gpu`` measures it on a GPU against the same bar; until then
    # a build at fp16 warns and its manifest says it is not known to pass.
    "fp16": {"passes": False, "measured_on": "not measured yet (qswap bench gpu measures it on a GPU)"},
}
# Texts tokenised per window: small enough that the first batch starts at once, large enough
# that token-budget batches of similar lengths form within it.
_WINDOW = 1024
_QUEUE = 4
# Queries per ONNX Runtime call at most (the server's ONNX backend's batch size).
_QUERY_ROWS = 64


def machine_threads() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count()`` elsewhere)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def default_runtime(precision: str) -> str:
    """The runtime a precision runs on (on a CPU): ONNX Runtime for fp32, torch for bf16, cuda for fp16."""
    return {"fp32": "onnx", "fp16": "cuda"}.get(precision, "torch")


def document_record(precision: str, runtime: str | None = None) -> dict[str, Any]:
    """What an index manifest records about its documents' embedding.

    Args:
        precision: one of :data:`DOCUMENT_PRECISIONS`.
        runtime: the runtime (default :func:`default_runtime`).

    Returns:
        ``{"precision", "runtime", "quality"}``: quality is the measured change against fp32.
    """
    check_document_precision(precision)
    return {"precision": precision, "runtime": runtime or default_runtime(precision),
            "quality": dict(PRECISION_QUALITY[precision])}


def check_document_precision(precision: str) -> str:
    """Return ``precision`` if documents may be embedded at it, else raise InvalidInputError."""
    if precision not in DOCUMENT_PRECISIONS:
        hint = "int8 fails the quality bar (see docs/embedding.md)" if precision.startswith("int8") else ""
        raise InvalidInputError(f"unknown document precision {precision!r}",
                                f"use one of {', '.join(DOCUMENT_PRECISIONS)}" + (f"; {hint}" if hint else ""))
    return precision


class DocumentEncoder:
    """Embeds documents with the base's document prefix; thread-safe (one job at a time).

    Args:
        base: the frozen base model.
        precision: ``fp32`` (default) or ``bf16``.
        runtime: ``onnx``, ``torch`` or ``cuda`` (default: cuda for a base on a GPU or for fp16, else
            ONNX Runtime for fp32, torch for bf16).
        threads: compute threads (default: every core this process may use).
        max_tokens: padded tokens per batch (:func:`token_budget_batches`; the cuda runtime's default
            is ``GPU_MAX_TOKENS``).
        cache_dir: where the ONNX export is cached (default ``<data dir>/onnx``).
    """

    def __init__(self, base: BaseEncoder, precision: str = "fp32", runtime: str | None = None,
                 threads: int | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
                 cache_dir: Path | None = None) -> None:
        check_document_precision(precision)
        if runtime is None:
            gpu = base.device_type == "cuda" or precision == "fp16"
            runtime = "cuda" if gpu else default_runtime(precision)
        if runtime not in RUNTIMES:
            raise InvalidInputError(f"unknown runtime {runtime!r}", f"use one of {', '.join(RUNTIMES)}")
        if runtime == "onnx" and precision != "fp32":
            raise InvalidInputError(f"{precision} documents run on torch, not ONNX Runtime",
                                    "use --runtime torch, or leave --runtime out")
        if precision == "fp16" and runtime != "cuda":
            raise InvalidInputError("fp16 documents run on the cuda runtime only", "use --runtime cuda")
        if threads is not None and threads < 1:
            raise InvalidInputError(f"threads must be >= 1, got {threads}", "omit it to use all cores")
        if max_tokens < 1:
            raise InvalidInputError(f"max_tokens must be >= 1, got {max_tokens}", "e.g. 8192")
        self.base = base
        self.precision = precision
        self.runtime = runtime
        quality = PRECISION_QUALITY[precision]
        if not quality["passes"]:
            verdict = (f"fail the quality bar (recall@10 {quality['recall_at_10']:.4f} of the fp32 top-10, bar "
                       f"{QUALITY_BAR['recall_at_10']:.3f})" if "recall_at_10" in quality
                       else f"are not known to pass the quality bar ({quality['measured_on']})")
            log.warning("%s documents %s: the index manifest records it; use fp32 where retrieval must not change",
                        precision, verdict)
        self.threads = threads or machine_threads()
        self.max_tokens = max_tokens
        self.window = _WINDOW
        if runtime == "cuda":
            from qswap.encoders.runtime.gpu_documents import GPU_MAX_TOKENS, GPU_WINDOW
            self.window = GPU_WINDOW
            if max_tokens == DEFAULT_MAX_TOKENS:   # the CPU's default: a GPU takes larger batches
                self.max_tokens = GPU_MAX_TOKENS
        if cache_dir is None:
            from qswap.paths import data_dir
            cache_dir = data_dir() / "onnx"
        self.cache_dir = Path(cache_dir)
        self.tokens_embedded = 0   # running totals over every call (read by progress bars)
        self.docs_embedded = 0
        self._session: Any = None
        self._table: np.ndarray | None = None
        self._model: Any = None   # the torch module documents run through (bf16: a bf16-Linear copy)
        self._gpu: Any = None     # the cuda runtime's GpuDocuments
        self._lock = threading.Lock()
        self._unpadded: Any = None   # see _tokenizer

    @property
    def _tokenizer(self) -> Any:
        """The producer thread's own tokenizer: windows are cut, not padded. Made on first use
        (seconds for a 250k-token vocabulary), which a process embedding only queries never makes."""
        if self._unpadded is None:
            self._unpadded = unpadded(self.base.tokenizer)
        return self._unpadded

    @property
    def record(self) -> dict[str, Any]:
        """:func:`document_record` of this encoder's precision and runtime."""
        return document_record(self.precision, self.runtime)

    def __call__(self, texts: list[str]) -> np.ndarray:
        """:meth:`encode` without a progress bar (the ``embed(texts)`` callables take this)."""
        return self.encode(texts)

    # -- runtime --------------------------------------------------------------------------------

    def _ensure_session(self) -> None:
        """Load (exporting on first use) the base's fused ONNX graph; the query path's cache."""
        if self._session is not None:
            return
        from qswap.encoders.runtime.export_digest import MODEL_FILE
        from qswap.encoders.runtime.onnx import available_providers, cached_export, make_session
        from qswap.names import BASE_KEY

        providers = available_providers()
        variant = "cuda" if "CUDAExecutionProvider" in providers else "cpu"
        # The directory OnnxBackend uses for the base key: one export serves queries and documents.
        target = self.cache_dir / BASE_KEY / self.base.space.fingerprint
        cached_export(self.base, {}, target, BASE_KEY, f"{variant}-fused", optimize_for=variant)
        # Spinning workers: a document batch is many parallel sections back to back.
        self._session = make_session(target / MODEL_FILE, self.threads, providers, spin=True)
        self._table = self.base.word_embedding_table()

    def _submit(self, ids: np.ndarray, mask: np.ndarray) -> Any:
        """``finish()`` of the batch: queued on the cuda runtime, computed now on the others."""
        if self.runtime == "cuda":
            return self._gpu.submit(ids, mask)
        vecs = self._forward(ids, mask)
        return lambda: vecs

    def _forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        if self.runtime == "onnx":
            emb = np.take(self._table, ids, axis=0)
            return self._session.run(None, {"inputs_embeds": emb, "attention_mask": mask}, run_options())[0]
        import torch

        from qswap.encoders.embedding import embed_batch
        dev = self.base.device
        t_ids, t_mask = torch.from_numpy(ids).to(dev), torch.from_numpy(mask).to(dev)
        return embed_batch(self._model, t_ids, t_mask, self.base.spec).float().cpu().numpy()

    # -- encoding -------------------------------------------------------------------------------

    def encode_queries(self, texts: list[str]) -> np.ndarray:
        """Embed ``texts`` as queries of the base (its query prefix, fp32).

        On ONNX Runtime: the base's graph this encoder embeds documents with, the one the
        server's ONNX backends serve the base's queries with, in length-sorted calls cut as theirs
        are (:data:`~qswap.encoders.runtime.onnx.CALL_TOKENS`). On the other runtimes: the torch
        base (:meth:`~qswap.encoders.base.BaseEncoder.encode_queries`).

        Args:
            texts: the queries.

        Returns:
            (len(texts), dim) float32, in input order.
        """
        if self.runtime != "onnx":
            return self.base.encode_queries(texts)
        from qswap.encoders.runtime.onnx import CALL_TOKENS

        out = np.empty((len(texts), self.base.dim), dtype=np.float32)
        if not texts:
            return out
        with self._lock:
            self._ensure_session()
            for idx, ids, mask in length_buckets(self.base.tokenizer, texts, self.base.spec.query_prefix,
                                                 _QUERY_ROWS, call_tokens=CALL_TOKENS):
                out[idx] = self._forward(ids, mask)
        return out

    def encode(self, texts: list[str], progress: bool = False, desc: str = "embedding documents") -> np.ndarray:
        """Embed ``texts`` as documents.

        Args:
            texts: the documents (the base's document prefix is added).
            progress: show a bar (tokens, tokens/s, docs/s, ETA) and a closing line on stderr.
            desc: the bar's label.

        Returns:
            (len(texts), dim) float32, L2-normalised if the base normalises, in input order.
        """
        out = np.empty((len(texts), self.base.dim), dtype=np.float32)
        if not texts:
            return out
        with self._lock:
            if self.runtime == "onnx":
                self._ensure_session()
            elif self.runtime == "cuda":
                if self._gpu is None:
                    from qswap.encoders.runtime.gpu_documents import GpuDocuments
                    self._gpu = GpuDocuments(self.base, self.precision)
            elif self._model is None:
                self._model = self.base.model
                if self.precision == "bf16":
                    from qswap.encoders.runtime.bf16_linear import bf16_linear_copy
                    from qswap.encoders.precision import has_fast_bf16, warn_emulated
                    if not has_fast_bf16(self.base.device):
                        warn_emulated(self.base.device.type)
                    self._model = bf16_linear_copy(self.base.model)
            meter = Throughput()
            bar = None
            if progress:
                from tqdm import tqdm
                # Counted in tokens: batches run longest first within a window, so a documents
                # count would make the first ETA far too long. The total is estimated from the
                # windows tokenised so far and made exact by the last one.
                bar = tqdm(total=None, desc=desc, unit="tok", unit_scale=True, file=sys.stderr,
                           dynamic_ncols=True, smoothing=0.05)
            try:
                self._run(texts, out, meter, bar)
            finally:
                if bar is not None:
                    bar.close()
            self.tokens_embedded += meter.tokens
            self.docs_embedded += meter.docs
        if progress:
            print(meter.summary(f"{desc}: {self.precision} on {self.runtime},"), file=sys.stderr)
        return out

    def _run(self, texts: list[str], out: np.ndarray, meter: Throughput, bar: Any) -> None:
        # ONNX Runtime needs no torch: a process embedding only on it never imports it.
        grad_off: Any = contextlib.nullcontext()
        if self.runtime != "onnx":
            import torch

            if self.runtime == "torch" and torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
            grad_off = torch.inference_mode()
        known_docs = known_tokens = 0
        pending: tuple[list[int], Any, int] | None = None   # the batch in flight (cuda runtime)

        def land(batch: tuple[list[int], Any, int]) -> None:
            idx, finish, tokens = batch
            out[idx] = finish()
            meter.add(len(idx), tokens)
            if bar is not None:
                bar.set_postfix_str(f"{meter.docs}/{len(texts)} docs, {meter.docs / meter.seconds():.1f} docs/s",
                                    refresh=False)
                bar.update(tokens)

        with grad_off:
            for idx, ids, mask, window in _produce(self, texts):
                if bar is not None and window is not None:
                    known_docs, known_tokens = known_docs + window[0], known_tokens + window[1]
                    bar.total = round(known_tokens * len(texts) / known_docs)
                batch = (idx, self._submit(ids, mask), int(mask.sum()))
                if pending is not None:
                    land(pending)
                pending = batch
            if pending is not None:
                land(pending)


_SHARED: dict[tuple[int, str], tuple[Any, DocumentEncoder]] = {}
_SHARED_LOCK = threading.Lock()


def document_encoder(base: BaseEncoder, precision: str = "fp32") -> DocumentEncoder:
    """The process's :class:`DocumentEncoder` of ``base`` at ``precision`` (default runtime and
    threads), made once: a job that embeds documents in several steps loads the graph once.

    Args:
        base: the frozen base model.
        precision: one of :data:`DOCUMENT_PRECISIONS`.

    Returns:
        The shared encoder (released with ``base``).
    """
    import weakref

    check_document_precision(precision)
    key = (id(base), precision)
    with _SHARED_LOCK:
        hit = _SHARED.get(key)
        if hit is not None and hit[0]() is base:
            return hit[1]
        enc = DocumentEncoder(base, precision=precision)
        # The dict itself is bound: at interpreter exit the module global may already be None.
        _SHARED[key] = (weakref.ref(base, lambda _r, k=key, d=_SHARED: d.pop(k, None)), enc)
        return enc


Batch = tuple[list[int], np.ndarray, np.ndarray, "tuple[int, int] | None"]


def _batches(enc: DocumentEncoder, texts: list[str], start: int) -> list[Batch]:
    """Tokenise one window and cut it into token-budget batches: (global indices, ids, mask,
    window); the first batch's ``window`` is the window's (documents, tokens), the others' None."""
    encs = enc._tokenizer.encode_batch([enc.base.spec.document_prefix + t for t in texts])
    lengths = [len(e) for e in encs]   # unpadded: each row's real tokens
    out = []
    for b in token_budget_batches(lengths, enc.max_tokens):
        ids, mask = padded_rows(encs, b, lengths[b[0]], pad_id(enc.base.tokenizer), unpadded=True)   # longest first
        out.append(([start + i for i in b], ids, mask, None if out else (len(texts), sum(lengths))))
    return out


def _produce(enc: DocumentEncoder, texts: list[str]) -> Iterator[Batch]:
    """Batches of ``texts``, tokenised by a producer thread one window ahead of the compute."""
    if len(texts) <= enc.window:   # one window: nothing to overlap with
        yield from _batches(enc, texts, 0)
        return
    q: queue.Queue[Any] = queue.Queue(maxsize=_QUEUE)
    stop = threading.Event()
    done = object()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def producer() -> None:
        try:
            for s in range(0, len(texts), enc.window):
                for b in _batches(enc, texts[s:s + enc.window], s):
                    if not put(b):
                        return
            put(done)
        except BaseException as e:   # handed to the consumer, which raises it
            put(e)

    t = threading.Thread(target=producer, name="qswap-tokenize", daemon=True)
    t.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        t.join()

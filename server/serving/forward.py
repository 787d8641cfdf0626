"""The forward stage of the batch worker: which rows form the next micro-batch, and encoding them.

:class:`ForwardStage` holds what the worker's middle thread needs besides its queues (the
thread itself, and what happens to a job before and after, is
:class:`~qswap.server.serving.batching.MicroBatcher`'s):

- the **token budget**: a batch holds at most ``max_batch`` rows and ``max_batch_tokens``
  (rows times its longest row, padding included: what the forward pass computes), one request
  at most ``slice_tokens`` of it; the first job of a batch may be split into slices
  (:meth:`ForwardStage.first_slice`), the others join whole (:meth:`ForwardStage.gather`);
- the **encoders**: queries of any encoders in one ``encode(texts, keys, encodings=...)`` call
  with the encodings the tokens stage made (a query is tokenised once; its truncation flags
  are read from them), texts for the document tower in batches of their own; a failing batch
  is retried request by request, so one bad row fails only its own request
  (:meth:`ForwardStage.encode`).
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any, Callable

import numpy as np

from qswap.encoders.embedding import token_lengths
from qswap.server.serving.admission import token_slices
from qswap.server.serving.answers import post
from qswap.server.serving.work import Job, Slice

log = logging.getLogger("qswap.server")

EncodeFn = Callable[[list[str], list[str]], np.ndarray]
EncodeFlagged = Callable[[list[str], list[str]], tuple[np.ndarray, list[bool]]]


class ForwardStage:
    """Batch forming under the token budget, and the forward pass (see the module docstring).

    Args:
        encode: ``(texts, keys) -> vectors``, row ``i`` with encoder ``keys[i]``; with ``tokenize``
            it also takes ``encodings=`` (a :class:`~qswap.encoders.runtime.protocol.Backend`).
        tokenize: the server's tokenizer for queries (``texts -> encodings``): each query job is
            tokenised once, in the tokens stage (unless its caller did), and encoded from those
            encodings. None: ``count_tokens`` counts, and the encode tokenises (a Ray ingress,
            whose encoders run in another process).
        truncated: which texts the tokenizer cuts (without ``tokenize`` and ``encode_flagged``).
        encode_flagged: vectors and truncation flags from one tokenisation (replaces both
            ``encode`` and ``truncated`` when the backend offers it).
        encode_documents: the document tower (jobs submitted with ``documents=True``).
        encode_bulk: how the bulk lane encodes query rows, ``(texts, keys) -> (vectors, flags)``
            (with ``tokenize`` it also takes ``encodings=``); None: as the first lane does.
        encode_single: the same signature, on one core (a single-threaded session): how a
            forward lane encodes while another lane is encoding too (``MicroBatcher(lanes=)``);
            None: lanes are not offered.
        count_tokens: tokens per text as the model sees them (None: every row costs one).
        max_batch: rows per forward pass at most.
        max_batch_tokens: rows x longest row per forward pass at most (None: no bound).
        slice_tokens: one request's share of a pass: a larger request is split into slices of
            this, and small requests fill the rest of the pass (None: ``max_batch_tokens``).
        metrics: the server's metrics (batch sizes, encode time), or None.
    """

    def __init__(self, *, encode: EncodeFn, tokenize: Callable[[list[str]], list[Any]] | None = None,
                 truncated: Callable[[list[str]], list[bool]] | None = None,
                 encode_flagged: EncodeFlagged | None = None,
                 encode_documents: Callable[[list[str]], np.ndarray] | None = None,
                 encode_bulk: EncodeFlagged | None = None, encode_single: EncodeFlagged | None = None,
                 count_tokens: Callable[[list[str]], list[int]] | None = None, max_batch: int = 64,
                 max_batch_tokens: int | None = None, slice_tokens: int | None = None,
                 metrics: Any = None) -> None:
        self.encode_fn = encode
        self.tokenize = tokenize
        self.truncated = truncated
        self.encode_flagged = encode_flagged
        self.encode_documents = encode_documents
        self.encode_bulk = encode_bulk
        self.encode_single = encode_single
        self.count_tokens = count_tokens
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.slice_tokens = slice_tokens if slice_tokens is not None else max_batch_tokens
        self.metrics = metrics

    # -- the token budget ----------------------------------------------------------------------

    def counted(self, job: Job) -> None:
        """Tokenise a query job and count its tokens per row, once (the tokens stage does it;
        what the caller brought stands)."""
        if self.tokenize is not None and not job.documents and job.encodings is None:
            job.encodings = self.tokenize(job.texts)
        if job.tokens is None:
            if self.tokenize is not None and job.encodings is not None:
                job.tokens = token_lengths(job.encodings)
            elif self.count_tokens is not None:
                job.tokens = self.count_tokens(job.texts)
            else:
                job.tokens = [1] * len(job.texts)

    def fits(self, rows: int, longest: int) -> bool:
        """Whether ``rows`` rows padded to ``longest`` tokens fit one forward pass."""
        return self.max_batch_tokens is None or rows * longest <= self.max_batch_tokens

    @staticmethod
    def longest(sl: Slice) -> int:
        """The longest row of ``sl`` in tokens."""
        return max(sl.job.tokens[sl.lo:sl.hi]) if sl.job.tokens else 1

    def is_bulk(self, job: Job) -> bool:
        """A request larger than one slice (or document rows): the bulk lane's."""
        return job.documents or (self.slice_tokens is not None and sum(job.tokens or [1]) > self.slice_tokens)

    def first_slice(self, job: Job) -> Slice:
        """The next rows of ``job`` that fit one batch (at least one row); its tokens are counted."""
        assert job.tokens is not None
        lo = job.next_row
        _, n = token_slices(job.tokens[lo:], self.slice_tokens, self.max_batch)[0]
        return Slice(job, lo, lo + n)

    def gather(self, first: Job, ready: queue.Queue, window: float,
               limit: int | None = None) -> tuple[list[Slice], Any]:
        """A batch: ``first``'s next slice, and the whole requests that join it from ``ready``
        within ``window`` seconds of ``first``'s arrival and within the budget (``limit``: at most
        that many rows, where fewer than ``max_batch``).

        Returns:
            The batch, and the item taken from ``ready`` that did not join it (None if none):
            the worker runs it next.
        """
        batch = [self.first_slice(first)]
        rows, longest = batch[0].hi - batch[0].lo, self.longest(batch[0])
        if first.documents:   # the document tower runs its own forward pass
            return batch, None
        deadline = first.enqueued + window
        most = self.max_batch if limit is None else min(limit, self.max_batch)
        while rows < most:
            wait = deadline - time.perf_counter()
            try:
                nxt = ready.get(timeout=wait) if wait > 0 else ready.get_nowait()
            except queue.Empty:
                break
            # Only whole requests join a batch; the first one is the one that is split.
            if not isinstance(nxt, Job) or nxt.next_row or nxt.documents or rows + len(nxt.texts) > most:
                return batch, nxt
            self.counted(nxt)
            n, top = len(nxt.texts), max(nxt.tokens or [1])
            big = self.slice_tokens is not None and n * top > self.slice_tokens
            if big or not self.fits(rows + n, max(longest, top)):   # a large one is split later
                return batch, nxt
            batch.append(Slice(nxt, 0, n))
            rows, longest = rows + n, max(longest, top)
        return batch, None

    # -- the forward pass ------------------------------------------------------------------------

    def _vectors(self, slices: list[Slice], texts: list[str], keys: list[str],
                 bulk: bool, single: bool = False) -> tuple[np.ndarray, list[bool]]:
        if slices[0].job.documents:   # a document batch holds document rows only
            assert self.encode_documents is not None
            return self.encode_documents(texts), [False] * len(texts)
        # The bulk lane and a one-core lane have encoders of their own, else the first lane's.
        lane = (self.encode_single if single and not bulk else self.encode_bulk if bulk else None)
        if self.tokenize is not None and all(sl.job.encodings is not None for sl in slices):
            encs = [e for sl in slices for e in sl.job.encodings[sl.lo:sl.hi]]   # type: ignore[index]
            flags = [bool(e.overflowing) for e in encs]
            if lane is not None:
                return lane(texts, keys, encodings=encs)[0], flags   # type: ignore[call-arg]
            return self.encode_fn(texts, keys, encodings=encs), flags
        if lane is not None:
            return lane(texts, keys)
        if self.encode_flagged is not None:
            return self.encode_flagged(texts, keys)
        trunc = self.truncated(texts) if self.truncated else [False] * len(texts)
        return self.encode_fn(texts, keys), trunc

    def encode(self, slices: list[Slice], bulk: bool = False, single: bool = False) -> bool:
        """Encode the rows of ``slices`` into their jobs (``bulk``: on the bulk lane; ``single``: on
        one core, with ``encode_single``, while another forward lane runs); False when the encode
        failed (posted)."""
        texts = [t for sl in slices for t in sl.job.texts[sl.lo:sl.hi]]
        keys = [sl.job.key for sl in slices for _ in range(sl.lo, sl.hi)]
        t0 = time.perf_counter()
        try:
            emb, trunc = self._vectors(slices, texts, keys, bulk, single)
        except Exception as e:
            if len(slices) > 1:
                # One bad row must not fail its neighbours: retry each request alone. Said in the
                # log: a batch that fails for every mix of requests costs one pass per request.
                log.warning("a forward pass of %d requests failed (%s: %s); each runs alone",
                            len(slices), type(e).__name__, e)
                return all([self.encode([sl], bulk, single) for sl in slices])
            post(slices[0].job.loop, slices[0].job.future, exc=e)
            slices[0].job.failed = True
            return False
        took = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(texts))
            self.metrics.batch_requests.observe(len(slices))
            self.metrics.encode_seconds.observe(took)
        o = 0
        for sl in slices:
            n = sl.hi - sl.lo
            sl.job.parts.append(emb[o:o + n])
            sl.job.trunc.extend(trunc[o:o + n])
            sl.job.next_row = sl.hi
            sl.job.encode_s += took
            o += n
        return True

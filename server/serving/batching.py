"""Dynamic micro-batching: concurrent searches share one forward pass and one index search.

Request handlers put a job on a queue and await an asyncio future. Three threads work in a
pipeline, so that each stage of one batch overlaps the others' work on the next:

1. **tokens**: counts each new job's tokens (what it costs a forward pass), off the event loop
   and off the forward thread;
2. **forward** (the batch worker): takes the first waiting job and whatever else is queued (up
   to ``max_batch`` queries; with ``window_s`` > 0 it waits that long for more), encodes all rows
   in one ``encode(texts, keys)`` call (rows of different encoders together) and hands the
   finished requests on. A model that is idle starts at once; requests arriving while it runs
   form the next batch;
3. **answers** (:mod:`qswap.server.serving.answers`): searches the index for them (one call per
   distinct filter) and posts the answers while the next forward runs.

The event loop never runs model code. Texts for the frozen document tower (``documents=True``: upserts, and
embeddings of ``qswap/documents``) are jobs of the same queue, sliced the same way, in batches
of their own; index writes are serialised on the forward thread through :meth:`MicroBatcher.call`.
Every job carries its request's :class:`~qswap.server.serving.admission.Ticket` (deadline,
client still there): the one admission path that every route reaching the model goes through.

Work is bounded in tokens as well as rows: a batch holds at most ``max_batch_tokens`` (rows
times its longest row, padding included: what the forward pass computes), and one request
at most ``slice_tokens`` of it. A larger request is split into slices; after each one its
remainder goes to the back of the queue, so other requests' batches interleave with it (a
one-query client waits for one slice, not for the whole request), and a request past its
deadline (or whose caller went away) stops between slices instead of holding the worker.

**Two lanes.** With ``bulk=True``, a request too large for one slice (more than
``slice_tokens`` tokens: a long query list, a 512-token embedding input, document rows) runs
its slices on a second forward thread, the *bulk lane*, one slice at a time and at a lower CPU
priority (a nice value of :data:`BULK_NICE` on that thread; ``encode_bulk`` runs it on a
single-threaded ONNX Runtime session where the backend has one). Interactive searches keep the
first lane to themselves: one of them waits for no slice of a large request at all, instead of
one slice (a 512-token row is a ~120 ms forward pass on two cores, ten times a short query's).

Admission is bounded: at most ``max_pending`` requests wait or run overall and at most
``max_pending_per_encoder`` for one encoder; beyond that a request is refused at once with
:class:`OverloadedError` (429 + ``Retry-After``) instead of joining a queue whose wait would
exceed any sane deadline. Every request carries a deadline; one still queued when it passes is
dropped without running (:class:`DeadlineExceededError`, 504), and its caller stops waiting.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from qswap.errors import DeadlineExceededError, NotReadyError, OverloadedError
from qswap.server.serving.admission import Ticket, token_slices
from qswap.server.serving.answers import EmbedOutcome, SearchFn, SearchOutcome, answer_batch
from qswap.server.serving.answers import post as _post

log = logging.getLogger("qswap.server")

EncodeFn = Callable[[list[str], list[str]], np.ndarray]
_STOP = object()

#: Nice value of the bulk lane's thread (the lowest priority): under contention the interactive
#: lane's threads get ~99 % of a shared core (CFS weights 1024 vs 15); alone, the bulk lane runs
#: at full speed. Measured with nice 10 (~90 %): normal-client p99 still ~2x under a long-query
#: attacker (bench adversarial, shared machine).
BULK_NICE = 19


@dataclass(eq=False)   # identity: jobs live in a set
class _Job:
    texts: list[str]
    key: str
    k: int
    filter: dict[str, Any] | None
    with_text: bool
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float
    deadline: float = float("inf")
    on_done: Callable[[], None] | None = None
    finished: bool = False
    tokens: list[int] | None = None      # per row, counted on the worker when first taken
    next_row: int = 0                    # rows before it are encoded (a split request)
    parts: list[np.ndarray] = field(default_factory=list)
    trunc: list[bool] = field(default_factory=list)
    started: float | None = None
    encode_s: float = 0.0
    failed: bool = False                 # its error is posted; nothing more runs for it
    vectors_only: bool = False           # an embedding request: encoded in the batch, not searched
    documents: bool = False              # rows for the document tower: never in a batch with queries
    answering: bool = False              # handed to the answer stage, which finishes it


@dataclass
class _Slice:
    """Rows ``lo:hi`` of one job in one micro-batch."""

    job: _Job
    lo: int
    hi: int


@dataclass(eq=False)
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    kwargs: dict[str, Any] = field(default_factory=dict)
    deadline: float = float("inf")
    key: str = ""
    finished: bool = False


class MicroBatcher:
    """One worker thread that batches searches; see the module docstring."""

    def __init__(self, *, encode: EncodeFn, search: SearchFn,
                 truncated: Callable[[list[str]], list[bool]] | None = None,
                 window_s: float = 0.002, max_batch: int = 64, max_pending: int = 256,
                 max_pending_per_encoder: int | None = None, metrics: Any = None,
                 name: str = "qswap-batcher", adaptive: bool = True,
                 encode_flagged: Callable[[list[str], list[str]], tuple[np.ndarray, list[bool]]] | None = None,
                 count_tokens: Callable[[list[str]], list[int]] | None = None,
                 max_batch_tokens: int | None = None, slice_tokens: int | None = None,
                 encode_documents: Callable[[list[str]], np.ndarray] | None = None,
                 bulk: bool = False,
                 encode_bulk: Callable[[list[str], list[str]], tuple[np.ndarray, list[bool]]] | None = None) -> None:
        # count_tokens: tokens per query as the model sees them (None: every row costs one);
        # max_batch_tokens: rows x longest row per forward pass at most (None: no bound);
        # slice_tokens: one request's share of a pass: a larger request is split into slices
        # of this, and small requests fill the rest of the pass (None: max_batch_tokens).
        # encode_flagged: vectors and truncation flags from one tokenisation (replaces both
        # ``encode`` and ``truncated`` when the backend offers it).
        # encode_documents: the document tower (jobs submitted with documents=True).
        # bulk: large requests run on a second, lower-priority forward thread (module docstring);
        # encode_bulk: how that lane encodes query rows (None: encode_flagged / encode).
        self._encode_flagged = encode_flagged
        self._encode = encode
        self._encode_documents = encode_documents
        self._search = search
        self._truncated = truncated
        self.window_s = window_s
        self.max_batch = max_batch
        self._count_tokens = count_tokens
        self.max_batch_tokens = max_batch_tokens
        self.slice_tokens = slice_tokens if slice_tokens is not None else max_batch_tokens
        self.max_pending = max_pending
        self.max_pending_per_encoder = max_pending_per_encoder or max_pending
        self.metrics = metrics
        self._pending = 0
        self._pending_by_key: dict[str, int] = {}
        self._live: set[Any] = set()   # admitted jobs and calls not finished (for abort)
        self._count_lock = threading.Lock()
        self._draining = False
        self._q: queue.Queue = queue.Queue()        # submitted, tokens not counted yet
        self._ready: queue.Queue = queue.Queue()    # counted: the forward thread's input
        self._answers: queue.Queue = queue.Queue()  # encoded batches: the answer thread's input
        self._bulk: queue.Queue = queue.Queue()     # large requests' next slices: the bulk lane's input
        self._encode_bulk = encode_bulk
        self._bulk_thread = (threading.Thread(target=self._bulk_loop, name=f"{name}-bulk", daemon=True)
                             if bulk else None)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stages = [threading.Thread(target=self._count_loop, name=f"{name}-tokens", daemon=True),
                        threading.Thread(target=self._answer_loop, name=f"{name}-answers", daemon=True)]
        self._stopped = False
        self.adaptive = adaptive
        self._last_requests = 1

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        for t in self._stages:
            t.start()
        if self._bulk_thread is not None:
            self._bulk_thread.start()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the batch in progress and answer it, refuse what is still queued, end the threads."""
        if self._stopped:
            return
        self._stopped = True
        self._q.put(_STOP)   # passes through every stage in order, behind what is queued
        end = time.monotonic() + timeout
        for t in (self._stages[0], self._thread, self._stages[1]):
            if t.is_alive():
                t.join(max(0.0, end - time.monotonic()))

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    # -- submission (event loop side) -------------------------------------------------------

    def drain(self) -> None:
        """Stop admitting (503 from now on); what is admitted still runs."""
        self._draining = True

    def abort(self, exc: Callable[[], Exception]) -> int:
        """Answer every admitted request that has not finished with ``exc()`` now (at the end of
        a drain). The worker skips their remaining work; a batch or write already running ends
        first on the worker, its result unused. Event loop side.

        Args:
            exc: makes the error each waiting caller gets.

        Returns:
            How many requests were answered.
        """
        with self._count_lock:
            items = list(self._live)
        n = 0
        for item in items:
            if not item.future.done():
                item.future.set_exception(exc())
                n += 1
        return n

    @property
    def pending(self) -> int:
        """Requests admitted and not finished (waiting or running)."""
        return self._pending

    def _reject(self, reason: str, exc: Exception) -> Exception:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason=reason).inc()
        return exc

    def _admit(self, key: str) -> None:
        if self._stopped or self._draining:
            raise self._reject("shutting_down", NotReadyError(
                "the server is shutting down", "retry against another instance"))
        with self._count_lock:
            if self._pending >= self.max_pending:
                raise self._reject("queue_full", OverloadedError(
                    f"the server is overloaded ({self._pending} requests admitted, limit {self.max_pending})",
                    "retry after the Retry-After seconds, or send fewer concurrent requests"))
            mine = self._pending_by_key.get(key, 0)
            if key and mine >= self.max_pending_per_encoder:
                raise self._reject("encoder_queue_full", OverloadedError(
                    f"encoder {key} is overloaded ({mine} requests admitted, "
                    f"limit {self.max_pending_per_encoder})",
                    "retry after the Retry-After seconds, or spread requests over encoders"))
            self._pending += 1
            if key:
                self._pending_by_key[key] = mine + 1

    def _release(self, key: str) -> None:
        with self._count_lock:
            self._pending -= 1
            if key:
                n = self._pending_by_key.get(key, 0) - 1
                if n > 0:
                    self._pending_by_key[key] = n
                else:
                    self._pending_by_key.pop(key, None)

    async def _wait(self, fut: asyncio.Future, deadline: float) -> Any:
        """The job's result; past the deadline the caller stops waiting (the job is dropped)."""
        remaining = deadline - time.perf_counter()
        if remaining == float("inf"):
            return await fut
        try:
            return await asyncio.wait_for(fut, max(remaining, 0.0))
        except asyncio.TimeoutError:
            if self.metrics is not None:
                self.metrics.expired.labels(stage="waiting").inc()
            raise DeadlineExceededError(
                "the request did not finish within its deadline and was dropped",
                "retry later, or give a longer X-Request-Timeout") from None

    async def search(self, texts: list[str], key: str, k: int, filter: dict[str, Any] | None = None,
                     with_text: bool = True, on_done: Callable[[], None] | None = None, *, ticket: Ticket,
                     tokens: list[int] | None = None) -> SearchOutcome:
        """Encode ``texts`` with encoder ``key`` and search; ``on_done`` runs exactly once,
        on the worker thread, when the job is finished, failed or found cancelled (or here,
        at once, when the job is refused). ``ticket``: the request's admission (its deadline,
        and whether its client is still there); ``tokens``: the queries' token counts when the
        caller has them (else the worker counts)."""
        return await self._submit(texts, key, k, filter, with_text, on_done, ticket, tokens, vectors_only=False)

    async def embed(self, texts: list[str], key: str, on_done: Callable[[], None] | None = None, *,
                    ticket: Ticket, tokens: list[int] | None = None, documents: bool = False) -> EmbedOutcome:
        """Encode ``texts`` with encoder ``key`` (or the document tower) and return the vectors.

        The rows join search batches like any query (same admission, deadline, token budget and
        forward pass); document rows are sliced the same way in batches of their own.

        Args:
            texts: the inputs.
            key: the exact encoder key (held by the caller until ``on_done``); with
                ``documents``, the name admission counts them under.
            on_done: runs exactly once when the job is finished, failed, dropped or refused.
            ticket: the request's admission (deadline; a client gone drops the rest).
            tokens: the inputs' token counts, when the caller has them.
            documents: embed with the frozen document tower instead of a query encoder.

        Returns:
            The vectors (float32, one row per text) and which texts the tokenizer cut.
        """
        return await self._submit(texts, key, 0, None, False, on_done, ticket, tokens, vectors_only=True,
                                  documents=documents)

    async def _submit(self, texts: list[str], key: str, k: int, filter: dict[str, Any] | None, with_text: bool,
                      on_done: Callable[[], None] | None, ticket: Ticket, tokens: list[int] | None,
                      vectors_only: bool, documents: bool = False) -> Any:
        try:
            if documents and self._encode_documents is None:
                raise NotReadyError("this server has no document tower", "send documents to a server with one")
            self._admit(key)
        except (NotReadyError, OverloadedError):
            if on_done is not None:
                on_done()
            raise
        loop = asyncio.get_running_loop()
        job = _Job(list(texts), key, k, filter, with_text, loop.create_future(), loop, time.perf_counter(),
                   ticket.deadline, on_done, tokens=list(tokens) if tokens is not None else None,
                   vectors_only=vectors_only, documents=documents)
        ticket.watch(job.future)
        with self._count_lock:
            self._live.add(job)
        self._q.put(job)
        return await self._wait(job.future, job.deadline)

    async def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
                   **kwargs: Any) -> Any:
        """Run ``fn(*args)`` on the worker thread (between batches) and return its result.

        A call still queued at its deadline is dropped; one that has started runs to its end
        (a write is never cut in the middle), its caller answered 504 meanwhile."""
        self._admit("")
        loop = asyncio.get_running_loop()
        deadline = time.perf_counter() + timeout_s if timeout_s is not None else float("inf")
        c = _Call(fn, args, loop.create_future(), loop, kwargs, deadline)
        with self._count_lock:
            self._live.add(c)
        self._q.put(c)
        return await self._wait(c.future, deadline)

    # -- worker thread -----------------------------------------------------------------------

    def _run(self) -> None:
        carry: Any = None
        while True:
            item = carry if carry is not None else self._ready.get()
            carry = None
            if item is _STOP:
                break
            try:
                if isinstance(item, _Call):
                    self._do_call(item)
                    continue
                if self._bulk_thread is not None and self._is_bulk(item):
                    self._bulk.put(item)
                    continue
                batch = [self._first_slice(item)]
                rows, longest = batch[0].hi - batch[0].lo, self._longest(batch[0])
                if item.documents:   # the document tower runs its own forward pass
                    self._last_requests = 1
                    self._process(batch)
                    continue
                # Adaptive window: after a batch of one (no concurrency), waiting only adds
                # latency, so take what is already queued and go; under load batches hold
                # several requests and the window lets more join.
                window = self.window_s if (self._last_requests > 1 or not self.adaptive) else 0.0
                deadline = item.enqueued + window
                while rows < self.max_batch:
                    wait = deadline - time.perf_counter()
                    try:
                        nxt = self._ready.get(timeout=wait) if wait > 0 else self._ready.get_nowait()
                    except queue.Empty:
                        break
                    # Only whole requests join a batch; the first one is the one that is split.
                    if (not isinstance(nxt, _Job) or nxt.next_row or nxt.documents
                            or rows + len(nxt.texts) > self.max_batch):
                        carry = nxt
                        break
                    self._counted(nxt)
                    n, top = len(nxt.texts), max(nxt.tokens or [1])
                    big = self.slice_tokens is not None and n * top > self.slice_tokens
                    if big or not self._fits(rows + n, max(longest, top)):   # a large one is split later
                        carry = nxt
                        break
                    batch.append(_Slice(nxt, 0, n))
                    rows, longest = rows + n, max(longest, top)
                self._last_requests = len(batch)
                self._process(batch)
            except Exception:   # never let the worker die: requests would hang
                log.exception("batch worker error")
        if self._bulk_thread is not None and self._bulk_thread.is_alive():
            self._bulk.put(_STOP)   # it ends its slice in progress; what is queued is refused below
            self._bulk_thread.join()
        self._drain()
        self._answers.put(_STOP)

    def _is_bulk(self, job: _Job) -> bool:
        """A request larger than one slice (or document rows): the bulk lane's."""
        return job.documents or (self.slice_tokens is not None and sum(job.tokens or [1]) > self.slice_tokens)

    def _bulk_loop(self) -> None:
        """The bulk lane: one slice of a large request per pass, at a lower CPU priority; the
        remainder goes back through the intake like any split request."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BULK_NICE)
        except (AttributeError, OSError):   # not Linux, or not allowed: same priority as the rest
            pass
        while True:
            item = self._bulk.get()
            if item is _STOP:
                return
            try:
                self._process([self._first_slice(item)], bulk=True)
            except Exception:   # never let the lane die: requests would hang
                log.exception("bulk lane error")

    # -- the other stages ----------------------------------------------------------------------

    def _count_loop(self) -> None:
        """Stage 1: count each new job's tokens, then queue it for the forward thread."""
        while True:
            item = self._q.get()
            if isinstance(item, _Job):
                try:
                    self._counted(item)
                except Exception:   # a tokenizer failure: every row costs one; the encode reports the error
                    item.tokens = [1] * len(item.texts)
            self._ready.put(item)
            if item is _STOP:
                return

    def _answer_loop(self) -> None:
        """Stage 3: search and answer the requests each forward pass completed."""
        while True:
            item = self._answers.get()
            if item is _STOP:
                return
            jobs, batch_requests, start = item
            try:
                answer_batch(jobs, batch_requests, start, self._search, self.metrics)
            except Exception as e:   # never leave a caller waiting
                log.exception("answer stage error")
                for j in jobs:
                    _post(j.loop, j.future, exc=e)
            finally:
                for j in jobs:
                    self._finish(j)

    # -- token budget (worker thread) ---------------------------------------------------------

    def _counted(self, job: _Job) -> None:
        if job.tokens is None:
            job.tokens = self._count_tokens(job.texts) if self._count_tokens is not None else [1] * len(job.texts)

    def _fits(self, rows: int, longest: int) -> bool:
        return self.max_batch_tokens is None or rows * longest <= self.max_batch_tokens

    @staticmethod
    def _longest(sl: _Slice) -> int:
        return max(sl.job.tokens[sl.lo:sl.hi]) if sl.job.tokens else 1

    def _first_slice(self, job: _Job) -> _Slice:
        """The next rows of ``job`` that fit one batch (at least one row); its tokens are counted."""
        assert job.tokens is not None
        lo = job.next_row
        _, n = token_slices(job.tokens[lo:], self.slice_tokens, self.max_batch)[0]
        return _Slice(job, lo, lo + n)

    def _drain(self) -> None:
        # The tokens stage and the bulk lane have ended: nothing moves between these queues.
        for q in (self._bulk, self._ready, self._q):
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, (_Job, _Call)):
                    _post(item.loop, item.future, exc=NotReadyError("the server is shutting down", "retry"))
                    self._finish(item)

    def _do_call(self, c: _Call) -> None:
        try:
            if c.future.done():   # cancelled, or answered by abort()
                return
            if time.perf_counter() > c.deadline:
                self._expire(c)
                return
            try:
                _post(c.loop, c.future, c.fn(*c.args, **c.kwargs))
            except Exception as e:
                _post(c.loop, c.future, exc=e)
        finally:
            self._finish(c)

    def _expire(self, item: "_Job | _Call") -> None:
        if self.metrics is not None:
            self.metrics.expired.labels(stage="queued").inc()
        _post(item.loop, item.future, exc=DeadlineExceededError(
            "the request waited in the queue past its deadline and was dropped",
            "retry later, or give a longer X-Request-Timeout"))

    def _finish(self, item: "_Job | _Call") -> None:
        if item.finished:
            return
        item.finished = True
        with self._count_lock:
            self._live.discard(item)
        self._release(item.key)
        on_done = getattr(item, "on_done", None)
        if on_done is not None:
            try:
                on_done()
            except Exception:
                log.exception("on_done callback failed")

    def _process(self, batch: list[_Slice], bulk: bool = False) -> None:
        start = time.perf_counter()
        live: list[_Slice] = []
        for sl in batch:
            j = sl.job
            if j.future.cancelled() or j.future.done():   # the client went away or stopped waiting
                self._finish(j)
            elif start > j.deadline:   # before its first micro-batch, or between two of them
                self._expire(j)
                self._finish(j)
            else:
                if j.started is None:
                    j.started = start
                live.append(sl)
        if not live:
            return
        try:
            self._run_batch(live, start, bulk)
        finally:
            for sl in live:
                j = sl.job
                if j.next_row < len(j.texts) and not j.failed:
                    # Back through the intake: its next micro-batch waits behind every request
                    # submitted meanwhile, counted or not.
                    self._q.put(j)
                elif not j.answering:
                    self._finish(j)

    def _encode_slices(self, slices: list[_Slice], bulk: bool = False) -> bool:
        """Encode the rows of ``slices`` into their jobs; False when the encode failed (posted)."""
        texts = [t for sl in slices for t in sl.job.texts[sl.lo:sl.hi]]
        keys = [sl.job.key for sl in slices for _ in range(sl.lo, sl.hi)]
        t0 = time.perf_counter()
        try:
            if slices[0].job.documents:   # a document batch holds document rows only
                assert self._encode_documents is not None
                emb, trunc = self._encode_documents(texts), [False] * len(texts)
            elif bulk and self._encode_bulk is not None:
                emb, trunc = self._encode_bulk(texts, keys)
            elif self._encode_flagged is not None:
                emb, trunc = self._encode_flagged(texts, keys)
            else:
                trunc = self._truncated(texts) if self._truncated else [False] * len(texts)
                emb = self._encode(texts, keys)
        except Exception as e:
            if len(slices) > 1:
                # One bad row must not fail its neighbours: retry each request alone.
                return all([self._encode_slices([sl], bulk) for sl in slices])
            _post(slices[0].job.loop, slices[0].job.future, exc=e)
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

    def _run_batch(self, slices: list[_Slice], start: float, bulk: bool = False) -> None:
        """Encode the slices; hand the requests they complete to the answer stage."""
        self._encode_slices(slices, bulk)
        jobs = [sl.job for sl in slices if sl.job.next_row == len(sl.job.texts) and not sl.job.failed]
        if jobs:
            for j in jobs:
                j.answering = True
            self._answers.put((jobs, len(slices), start))

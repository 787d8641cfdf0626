"""Dynamic micro-batching: concurrent searches share one forward pass and one index search.

Request handlers put a job (:mod:`qswap.server.serving.work`) on a queue and await an asyncio
future. Three threads work in a pipeline, so that each stage of one batch overlaps the others'
work on the next:

1. **tokens**: tokenises each new query job once and counts its tokens (what it costs a forward
   pass), off the event loop and off the forward thread;
2. **forward** (the batch worker, :mod:`qswap.server.serving.forward`): takes the first waiting
   job and whatever else is queued (up to ``max_batch`` queries; with ``window_s`` > 0 it waits
   that long for more), encodes all rows in one ``encode(texts, keys)`` call (rows of different
   encoders together) and hands the finished requests on. A model that is idle starts at once;
   requests arriving while it runs form the next batch;
3. **answers** (:mod:`qswap.server.serving.answers`): searches the index for them (one call per
   distinct filter) and posts the answers while the next forward runs.

The event loop never runs model code. Texts for the frozen document tower (``documents=True``: upserts, and
embeddings of ``qswap/documents``) are jobs of the same queue, sliced the same way, in batches
of their own; index writes are serialised on a thread of their own through :meth:`MicroBatcher.call`
(:mod:`qswap.server.serving.writes`), so that a commit does not hold up the forward pass.
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
its slices on a second forward thread, the *bulk lane*, one slice at a time and at the lowest
CPU priority (Linux's ``SCHED_IDLE`` on that thread, :func:`~qswap.server.serving.lowprio.idle_priority`;
``encode_bulk`` runs it on a single-threaded ONNX Runtime session where the backend has one),
and its finished requests are answered on an answer thread of their own.
Interactive searches keep the first lane to themselves: one of them waits for no slice of a
large request at all, instead of one slice (a 512-token row is a ~120 ms forward pass on two
cores, ten times a short query's). A large request still to be tokenised (more than
:data:`INLINE_CHARS` characters) is tokenised on a low-priority thread of the bulk lane
(:class:`~qswap.server.serving.lowprio.LowPriority`), not in the tokens stage, where every
one-query search would wait behind it. A bulk pass whose request ends meanwhile (client gone,
deadline passed) is stopped in the middle (:mod:`qswap.encoders.runtime.cancel`), not at its end.

**Forward lanes.** With ``lanes`` > 1 (and a backend that can encode on one core,
``encode_single``), that many forward threads take batches from the same queue. A lane that
starts a batch while no other lane is encoding runs it as one lane does, on all cores; one that
starts while another lane is encoding runs it on one core (single-threaded sessions: the shared
graph's, and a hot encoder's one-core twin of its merged session), and takes at most half of
the requests waiting, so that its slower pass does not hold every waiting request while the
other lane runs dry (the rest go to whichever lane is free first). Under concurrency two batches
then run side by side, one core each, instead of one batch at a time on both: a two-thread ONNX
Runtime call loses much of its second thread to the event loop and the answer thread on a
two-core machine (each of its parallel sections waits for the thread that was preempted), while
two one-thread calls go on independently. With one request at a time, a single lane is busy and
runs on all cores, as before.

**Idle.** A request admitted while nothing else is (no other request waiting or running)
skips the tokens stage: the forward lane tokenises it when it takes it. A batch whose requests
are the only ones admitted when its forward pass ends is answered on the forward lane itself,
not handed to the answer stage. With one request at a time each request then crosses two
threads fewer; under concurrency the pipeline runs as above.

Admission is bounded: at most ``max_pending`` requests wait or run overall and at most
``max_pending_per_encoder`` for one encoder; beyond that a request is refused at once with
:class:`OverloadedError` (429 + ``Retry-After``) instead of joining a queue whose wait would
exceed any sane deadline. Every request carries a deadline; one still queued when it passes is
dropped without running (:class:`DeadlineExceededError`, 504), and its caller stops waiting.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from qswap.encoders.runtime.cancel import Cancel, cancellable
from qswap.errors import DeadlineExceededError, NotReadyError, OverloadedError
from qswap.index.backends import search_on_this_thread
from qswap.server.serving.admission import Ticket
from qswap.server.serving.answers import EmbedOutcome, SearchFn, SearchOutcome, answer_batch, post
from qswap.server.serving.forward import EncodeFlagged, EncodeFn, ForwardStage
from qswap.server.serving.lowprio import LowPriority, idle_priority
from qswap.server.serving.work import STOP, Call, Job, Slice
from qswap.server.serving.writes import WriteLane

log = logging.getLogger("qswap.server")

#: A request with more characters than this, not yet tokenised, is tokenised on the bulk lane's
#: low-priority thread (with the bulk lane on). ~1,000 tokens of English text, ~2 ms of tokenizer
#: time: what a one-query search may wait for behind another request in the tokens stage.
INLINE_CHARS = 4096


def _stop_when_done(fut: asyncio.Future, cancel: Cancel) -> None:
    """Stop the bulk lane's pass when its request's future ends before it (event loop side): a
    future answered normally ends after its last pass, when stopping changes nothing."""
    fut.add_done_callback(lambda _: cancel.stop())


class MicroBatcher:
    """One worker thread that batches searches; see the module docstring."""

    def __init__(self, *, encode: EncodeFn, search: SearchFn,
                 tokenize: Callable[[list[str]], list[Any]] | None = None,
                 truncated: Callable[[list[str]], list[bool]] | None = None,
                 window_s: float = 0.002, max_batch: int = 64, max_pending: int = 256,
                 max_pending_per_encoder: int | None = None, metrics: Any = None,
                 name: str = "qswap-batcher", adaptive: bool = True,
                 encode_flagged: EncodeFlagged | None = None,
                 count_tokens: Callable[[list[str]], list[int]] | None = None,
                 max_batch_tokens: int | None = None, slice_tokens: int | None = None,
                 encode_documents: Callable[[list[str]], np.ndarray] | None = None,
                 bulk: bool = False, encode_bulk: EncodeFlagged | None = None,
                 lanes: int = 1, encode_single: EncodeFlagged | None = None) -> None:
        # encode, tokenize, truncated, encode_flagged, encode_documents, encode_bulk, count_tokens,
        # max_batch, max_batch_tokens, slice_tokens: the forward stage's (qswap.server.serving.forward).
        # bulk: large requests run on a second, lower-priority forward thread (module docstring).
        # lanes: forward threads (module docstring, "Forward lanes"); 1 without encode_single.
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        self.forward = ForwardStage(encode=encode, tokenize=tokenize, truncated=truncated,
                                    encode_flagged=encode_flagged, encode_documents=encode_documents,
                                    encode_bulk=encode_bulk, encode_single=encode_single, count_tokens=count_tokens, max_batch=max_batch,
                                    max_batch_tokens=max_batch_tokens, slice_tokens=slice_tokens, metrics=metrics)
        self._search = search
        self.window_s = window_s
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
        # The bulk lane's finished requests are answered on a thread of their own: fetching and
        # building a large answer (64 queries x 100 hits with their texts) took ~40 ms, and every
        # one-query search finished meanwhile waited behind it on a shared answer thread.
        self._bulk_answers: queue.Queue | None = queue.Queue() if bulk else None
        self._bulk: queue.Queue = queue.Queue()     # large requests' next slices: the bulk lane's input
        self._bulk_thread = (threading.Thread(target=self._bulk_loop, name=f"{name}-bulk", daemon=True)
                             if bulk else None)
        self.low = LowPriority(f"{name}-bulk-tokens") if bulk else None   # large requests' tokenising
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.lanes = lanes if encode_single is not None else 1
        self._lanes = [threading.Thread(target=self._lane, args=(False,), name=f"{name}-lane{i}", daemon=True)
                       for i in range(1, self.lanes)]
        self._encoding = 0   # lanes encoding now (under _lanes_cond)
        self._lanes_cond = threading.Condition()
        self._writes = WriteLane(self._do_call, f"{name}-writes")   # index writes, in order
        self._stages = [threading.Thread(target=self._count_loop, name=f"{name}-tokens", daemon=True),
                        threading.Thread(target=self._answer_loop, args=(self._answers,), name=f"{name}-answers",
                                         daemon=True)]
        if self._bulk_answers is not None:
            self._stages.append(threading.Thread(target=self._answer_loop, args=(self._bulk_answers,),
                                                 name=f"{name}-bulk-answers", daemon=True))
        self._stopped = False
        self.adaptive = adaptive
        self._last_requests = 1

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        for t in self._stages:
            t.start()
        if self._bulk_thread is not None:
            self._bulk_thread.start()
        self._writes.start()
        self._thread.start()
        for t in self._lanes:
            t.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the batch in progress and answer it, refuse what is still queued, end the threads."""
        if self._stopped:
            return
        self._stopped = True
        self._q.put(STOP)   # passes through every stage in order, behind what is queued
        end = time.monotonic() + timeout
        for t in (self._stages[0], self._thread, *self._stages[1:]):
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
        """The job's result; past the deadline the caller stops waiting (the job is dropped: its
        future is cancelled, which the worker sees)."""
        remaining = deadline - time.perf_counter()
        if remaining == float("inf"):
            return await fut
        # A timer that cancels the future, not asyncio.wait_for: that wraps every request in a
        # second future and callback and wakes the task once more when the answer comes.
        expired = False

        def expire() -> None:
            nonlocal expired
            if not fut.done():
                expired = True
                fut.cancel()

        timer = asyncio.get_running_loop().call_later(max(remaining, 0.0), expire)
        try:
            return await fut
        except asyncio.CancelledError:
            if not expired:   # the caller itself was cancelled
                raise
            if self.metrics is not None:
                self.metrics.expired.labels(stage="waiting").inc()
            raise DeadlineExceededError(
                "the request did not finish within its deadline and was dropped",
                "retry later, or give a longer X-Request-Timeout") from None
        finally:
            timer.cancel()

    async def search(self, texts: list[str], key: str, k: int, filter: dict[str, Any] | None = None,
                     with_text: bool = True, on_done: Callable[[], None] | None = None, *, ticket: Ticket,
                     tokens: list[int] | None = None, encodings: list[Any] | None = None) -> SearchOutcome:
        """Encode ``texts`` with encoder ``key`` and search; ``on_done`` runs exactly once,
        on the worker thread, when the job is finished, failed or found cancelled (or here,
        at once, when the job is refused). ``ticket``: the request's admission (its deadline,
        and whether its client is still there); ``tokens`` / ``encodings``: the queries' token
        counts / tokenizer encodings when the caller has them (else the worker makes them, once)."""
        return await self._submit(texts, key, k, filter, with_text, on_done, ticket, tokens, encodings,
                                  vectors_only=False)

    async def embed(self, texts: list[str], key: str, on_done: Callable[[], None] | None = None, *,
                    ticket: Ticket, tokens: list[int] | None = None, encodings: list[Any] | None = None,
                    documents: bool = False) -> EmbedOutcome:
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
            encodings: the queries' tokenizer encodings (query prefix), when the caller has them.
            documents: embed with the frozen document tower instead of a query encoder.

        Returns:
            The vectors (float32, one row per text) and which texts the tokenizer cut.
        """
        return await self._submit(texts, key, 0, None, False, on_done, ticket, tokens, encodings,
                                  vectors_only=True, documents=documents)

    async def _submit(self, texts: list[str], key: str, k: int, filter: dict[str, Any] | None, with_text: bool,
                      on_done: Callable[[], None] | None, ticket: Ticket, tokens: list[int] | None,
                      encodings: list[Any] | None, vectors_only: bool, documents: bool = False) -> Any:
        try:
            if documents and self.forward.encode_documents is None:
                raise NotReadyError("this server has no document tower", "send documents to a server with one")
            self._admit(key)
        except (NotReadyError, OverloadedError):
            if on_done is not None:
                on_done()
            raise
        loop = asyncio.get_running_loop()
        job = Job(list(texts), key, k, filter, with_text, loop.create_future(), loop, time.perf_counter(),
                  ticket.deadline, on_done, tokens=list(tokens) if tokens is not None else None,
                  encodings=encodings, vectors_only=vectors_only, documents=documents)
        ticket.watch(job.future)
        with self._count_lock:
            self._live.add(job)
        if self._pending == 1 and not (self.low is not None and self._large(job)):
            # Nothing else admitted: no job waits to be tokenised ahead of this one, so the forward
            # lane tokenises it itself, one hand-off between threads fewer (module docstring, "Idle").
            self._ready.put(job)
        else:
            self._q.put(job)
        return await self._wait(job.future, job.deadline)

    async def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
                   **kwargs: Any) -> Any:
        """Run ``fn(*args)`` on the writes thread (after the writes queued before it) and return its result.

        A call still queued at its deadline is dropped; one that has started runs to its end
        (a write is never cut in the middle), its caller answered 504 meanwhile."""
        self._admit("")
        loop = asyncio.get_running_loop()
        deadline = time.perf_counter() + timeout_s if timeout_s is not None else float("inf")
        c = Call(fn, args, loop.create_future(), loop, kwargs, deadline)
        with self._count_lock:
            self._live.add(c)
        self._writes.put(c)
        return await self._wait(c.future, deadline)

    async def low_priority(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` off the event loop: on the bulk lane's low-priority thread (a large
        request's tokenising, in its route), or a default executor thread without the bulk lane."""
        if self.low is None:
            return await asyncio.to_thread(fn, *args)
        return await self.low.run(fn, *args)

    # -- worker thread -----------------------------------------------------------------------

    def _run(self) -> None:
        self._lane(True)
        for _ in self._lanes:   # the other lanes end their batch in progress, then stop
            self._ready.put(STOP)
        for t in self._lanes:
            t.join()
        self._shutdown()

    def _lane(self, first: bool) -> None:
        """One forward lane: batches from the ready queue until STOP (module docstring). The
        first lane (the worker thread) shuts the batcher down after it; another lane that takes
        the one STOP puts it back for the first."""
        search_on_this_thread()   # an idle batch is answered on this thread (below): one core, as the answer stage
        carry: Any = None
        while True:
            item = carry if carry is not None else self._ready.get()
            carry = None
            if item is STOP:
                if not first:
                    self._ready.put(STOP)
                return
            try:
                if isinstance(item, Job) and item.tokens is None:   # taken straight from _submit when idle
                    self._counted(item)
                if self._bulk_thread is not None and self.forward.is_bulk(item):
                    self._bulk.put(item)
                    continue
                # Adaptive window: after a batch of one (no concurrency), waiting only adds
                # latency, so take what is already queued and go; under load batches hold
                # several requests and the window lets more join.
                window = self.window_s if (self._last_requests > 1 or not self.adaptive) else 0.0
                with self._lanes_cond:
                    busy = self._encoding > 0
                # Beside a busy lane: half of what waits (this request included), the rest for whichever
                # lane is free first. Taking all of it, a one-core pass held every waiting request while
                # the other lane ran dry (one domain, concurrency 32: p99 1.3-1.5x, bench/results/cycle/lane14-half).
                limit = (self._ready.qsize() + 2) // 2 if busy else None
                counted = False
                idle = None
                try:
                    batch, carry = self.forward.gather(item, self._ready, window, limit)
                    self._last_requests = len(batch)
                    with self._lanes_cond:
                        single = self._encoding > 0   # another lane is encoding: one core
                        self._encoding += 1
                    counted = True
                    idle = self._process(batch, single=single)
                finally:
                    if counted:
                        with self._lanes_cond:
                            self._encoding -= 1
                            self._lanes_cond.notify_all()
                if idle is not None:
                    # Answered only once this lane no longer counts as encoding: its client may send the
                    # next request at once, and that one must find no lane busy (all cores), as before.
                    self._answer(*idle)
            except Exception:   # never let the worker die: requests would hang
                log.exception("batch worker error")

    def _shutdown(self) -> None:
        """After the lanes have stopped: end the other stages, refuse what is still queued."""
        if self.low is not None:
            self.low.close()   # a request it was tokenising is in the intake now: refused below
        if self._bulk_thread is not None and self._bulk_thread.is_alive():
            self._bulk.put(STOP)   # it ends its slice in progress; what is queued is refused below
            self._bulk_thread.join()
        self._drain(self._writes.stop(10.0))
        self._answers.put(STOP)
        if self._bulk_answers is not None:
            self._bulk_answers.put(STOP)

    def _bulk_loop(self) -> None:
        """The bulk lane: one slice of a large request per pass, at a lower CPU priority; the
        remainder goes back through the intake like any split request. A pass whose request
        ends meanwhile (client gone, deadline passed, server stopping) is stopped in the middle."""
        idle_priority()
        while True:
            item = self._bulk.get()
            if item is STOP:
                return
            try:
                with cancellable() as cancel:
                    try:
                        item.loop.call_soon_threadsafe(_stop_when_done, item.future, cancel)
                    except RuntimeError:   # the loop is closed: the pass runs to its end
                        pass
                    self._process([self.forward.first_slice(item)], bulk=True)
            except Exception:   # never let the lane die: requests would hang
                log.exception("bulk lane error")

    # -- the other stages ----------------------------------------------------------------------

    def _count_loop(self) -> None:
        """Stage 1: tokenise each new query job once and count its tokens, then queue it for the forward thread."""
        while True:
            item = self._q.get()
            if isinstance(item, Job):
                if self.low is not None and self._large(item):
                    self.low.submit(self._count, item)   # queued for the forward thread from there
                    continue
                self._count(item)
            else:
                self._ready.put(item)
            if item is STOP:
                return

    def _large(self, job: Job) -> bool:
        """A request still to be tokenised that is too large for the tokens stage (INLINE_CHARS)."""
        todo = job.tokens is None or (self.forward.tokenize is not None and not job.documents
                                      and job.encodings is None)
        return todo and sum(len(t) for t in job.texts) > INLINE_CHARS

    def _count(self, job: Job) -> None:
        self._counted(job)
        self._ready.put(job)

    def _counted(self, job: Job) -> None:
        try:
            self.forward.counted(job)
        except Exception:   # a tokenizer failure: every row costs one; the encode reports the error
            job.tokens = [1] * len(job.texts)

    def _answer_loop(self, inbox: queue.Queue) -> None:
        """Stage 3: search and answer the requests each forward pass completed (``inbox``: the
        first lane's or the bulk lane's)."""
        search_on_this_thread()   # its searches run beside a forward pass: one core each
        while True:
            item = inbox.get()
            if item is STOP:
                return
            self._answer(*item)

    def _answer(self, jobs: list[Job], batch_requests: int, start: float) -> None:
        """Search and answer ``jobs`` (every row encoded), then finish them: the answer stage's
        work, or the forward lane's for an idle batch."""
        try:
            answer_batch(jobs, batch_requests, start, self._search, self.metrics)
        except Exception as e:   # never leave a caller waiting
            log.exception("answer stage error")
            for j in jobs:
                post(j.loop, j.future, exc=e)
        finally:
            for j in jobs:
                self._finish(j)

    def _drain(self, writes: list[Call]) -> None:
        # The tokens stage, the bulk lane and the writes thread have ended: nothing moves between
        # these queues. ``writes``: the index writes that were still queued.
        left: list[Any] = list(writes)
        for q in (self._bulk, self._ready, self._q):
            while True:
                try:
                    left.append(q.get_nowait())
                except queue.Empty:
                    break
        for item in left:
            if isinstance(item, (Job, Call)):
                post(item.loop, item.future, exc=NotReadyError("the server is shutting down", "retry"))
                self._finish(item)

    def _do_call(self, c: Call) -> None:
        try:
            if c.future.done():   # cancelled, or answered by abort()
                return
            if time.perf_counter() > c.deadline:
                self._expire(c)
                return
            try:
                post(c.loop, c.future, c.fn(*c.args, **c.kwargs))
            except Exception as e:
                post(c.loop, c.future, exc=e)
        finally:
            self._finish(c)

    def _expire(self, item: Job | Call) -> None:
        if self.metrics is not None:
            self.metrics.expired.labels(stage="queued").inc()
        post(item.loop, item.future, exc=DeadlineExceededError(
            "the request waited in the queue past its deadline and was dropped",
            "retry later, or give a longer X-Request-Timeout"))

    def _finish(self, item: Job | Call) -> None:
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

    def _process(self, batch: list[Slice], bulk: bool = False,
                 single: bool = False) -> tuple[list[Job], int, float] | None:
        """Run one batch; returns an idle batch's requests for the caller to answer (:meth:`_run_batch`)."""
        start = time.perf_counter()
        live: list[Slice] = []
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
            return None
        try:
            return self._run_batch(live, start, bulk, single)
        finally:
            for sl in live:
                j = sl.job
                if j.next_row < len(j.texts) and not j.failed:
                    # Back through the intake: its next micro-batch waits behind every request
                    # submitted meanwhile, counted or not.
                    self._q.put(j)
                elif not j.answering:
                    self._finish(j)

    def _run_batch(self, slices: list[Slice], start: float, bulk: bool = False,
                   single: bool = False) -> tuple[list[Job], int, float] | None:
        """Encode the slices (``single``: on one core); hand the requests they complete to the answer stage,
        or, when they are the only ones admitted, return them (with the batch's size and start) for the
        forward lane to answer itself (:meth:`_answer`)."""
        self.forward.encode(slices, bulk, single)
        jobs = [sl.job for sl in slices if sl.job.next_row == len(sl.job.texts) and not sl.job.failed]
        if jobs:
            for j in jobs:
                j.answering = True
            if not bulk and self._pending == len(jobs):
                # Idle: nothing else admitted (no request waiting, no other batch encoding or being
                # answered), so no next forward pass could overlap the answer stage: the lane answers,
                # one hand-off between threads fewer (module docstring, "Idle").
                return jobs, len(slices), start
            inbox = self._bulk_answers if bulk and self._bulk_answers is not None else self._answers
            inbox.put((jobs, len(slices), start))
        return None

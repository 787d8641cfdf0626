"""Dynamic micro-batching: concurrent searches share one forward pass and one index search.

Request handlers put a job on a queue and await an asyncio future; one dedicated worker thread
takes the first waiting job, collects whatever else arrives within ``window_s`` of it (up to
``max_batch`` queries), encodes all rows in one ``encode(texts, keys)`` call (rows of different
encoders together) and searches them with one index call per distinct filter. The event loop
never runs model code. Other model work (embedding documents) is serialised on the same
thread through :meth:`MicroBatcher.call`.

Work is bounded in tokens as well as rows: a batch holds at most ``max_batch_tokens`` (rows
times its longest row, padding included: what the forward pass computes), and one request
at most ``slice_tokens`` of it. A larger request is split into slices; after each one its
remainder goes to the back of the queue, so other requests' batches interleave with it (a
one-query client waits for one slice, not for the whole request), and a request past its
deadline (or whose caller went away) stops between slices instead of holding the worker.

Admission is bounded: at most ``max_pending`` requests wait or run overall and at most
``max_pending_per_encoder`` for one encoder; beyond that a request is refused at once with
:class:`OverloadedError` (429 + ``Retry-After``) instead of joining a queue whose wait would
exceed any sane deadline. Every request carries a deadline; one still queued when it passes is
dropped without running (:class:`DeadlineExceededError`, 504), and its caller stops waiting.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from qswap.errors import DeadlineExceededError, NotReadyError, OverloadedError

log = logging.getLogger("qswap.server")

EncodeFn = Callable[[list[str], list[str]], np.ndarray]
SearchFn = Callable[[np.ndarray, int, "dict[str, Any] | None", bool], list[list[Any]]]
_STOP = object()


@dataclass
class SearchOutcome:
    """What one request gets back: hits per query and where its time went."""

    hits: list[list[Any]]
    truncated: list[bool]
    queue_s: float
    encode_s: float
    search_s: float
    batch_requests: int


@dataclass
class EmbedOutcome:
    """What an embedding request gets back: one vector per text, as the encoder returns it."""

    vectors: np.ndarray
    truncated: list[bool]
    queue_s: float
    encode_s: float


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


def token_slices(tokens: list[int], max_tokens: int | None, max_rows: int | None = None) -> list[tuple[int, int]]:
    """Consecutive row ranges for forward passes: rows x longest row within ``max_tokens`` and
    at most ``max_rows`` rows, at least one row each (a row alone may exceed the bound).

    Args:
        tokens: tokens per row.
        max_tokens: the bound of one forward pass (None: none).
        max_rows: rows per pass at most (None: none).

    Returns:
        ``(lo, hi)`` ranges covering every row, in order.
    """
    out: list[tuple[int, int]] = []
    lo, longest = 0, 0
    for i, t in enumerate(tokens):
        top = max(longest, t)
        n = i - lo + 1
        if i > lo and ((max_tokens is not None and n * top > max_tokens) or (max_rows is not None and n > max_rows)):
            out.append((lo, i))
            lo, top = i, t
        longest = top
    if lo < len(tokens):
        out.append((lo, len(tokens)))
    return out


def _resolve(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _post(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any = None,
          exc: BaseException | None = None) -> None:
    try:
        loop.call_soon_threadsafe(_resolve, fut, result, exc)
    except RuntimeError:   # the loop is closed: nobody waits any more
        pass


class MicroBatcher:
    """One worker thread that batches searches; see the module docstring."""

    def __init__(self, *, encode: EncodeFn, search: SearchFn,
                 truncated: Callable[[list[str]], list[bool]] | None = None,
                 window_s: float = 0.002, max_batch: int = 64, max_pending: int = 256,
                 max_pending_per_encoder: int | None = None, metrics: Any = None,
                 name: str = "qswap-batcher", adaptive: bool = True,
                 encode_flagged: Callable[[list[str], list[str]], tuple[np.ndarray, list[bool]]] | None = None,
                 count_tokens: Callable[[list[str]], list[int]] | None = None,
                 max_batch_tokens: int | None = None, slice_tokens: int | None = None) -> None:
        # count_tokens: tokens per query as the model sees them (None: every row costs one);
        # max_batch_tokens: rows x longest row per forward pass at most (None: no bound);
        # slice_tokens: one request's share of a pass: a larger request is split into slices
        # of this, and small requests fill the rest of the pass (None: max_batch_tokens).
        # encode_flagged: vectors and truncation flags from one tokenisation (replaces both
        # ``encode`` and ``truncated`` when the backend offers it).
        self._encode_flagged = encode_flagged
        self._encode = encode
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
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = False
        self.adaptive = adaptive
        self._last_requests = 1

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the batch in progress, refuse what is still queued, end the thread."""
        if self._stopped:
            return
        self._stopped = True
        self._q.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

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
                     with_text: bool = True, on_done: Callable[[], None] | None = None,
                     timeout_s: float | None = None, tokens: list[int] | None = None) -> SearchOutcome:
        """Encode ``texts`` with encoder ``key`` and search; ``on_done`` runs exactly once,
        on the worker thread, when the job is finished, failed or found cancelled (or here,
        at once, when the job is refused). ``timeout_s`` is the request's deadline from now;
        ``tokens``: the queries' token counts when the caller has them (else the worker counts)."""
        return await self._submit(texts, key, k, filter, with_text, on_done, timeout_s, tokens, vectors_only=False)

    async def embed(self, texts: list[str], key: str, on_done: Callable[[], None] | None = None,
                    timeout_s: float | None = None, tokens: list[int] | None = None) -> EmbedOutcome:
        """Encode ``texts`` with encoder ``key`` and return the vectors (no search).

        The rows join search batches like any query (same admission, deadline, token budget and
        forward pass); ``on_done``, ``timeout_s`` and ``tokens`` as in :meth:`search`.

        Args:
            texts: the inputs (callers chunk long lists).
            key: the exact encoder key (held by the caller until ``on_done``).
            on_done: runs exactly once when the job is finished, failed, dropped or refused.
            timeout_s: the request's deadline in seconds from now.
            tokens: the inputs' token counts, when the caller has them.

        Returns:
            The vectors (float32, one row per text) and which texts the tokenizer cut.
        """
        return await self._submit(texts, key, 0, None, False, on_done, timeout_s, tokens, vectors_only=True)

    async def _submit(self, texts: list[str], key: str, k: int, filter: dict[str, Any] | None, with_text: bool,
                      on_done: Callable[[], None] | None, timeout_s: float | None, tokens: list[int] | None,
                      vectors_only: bool) -> Any:
        try:
            self._admit(key)
        except (NotReadyError, OverloadedError):
            if on_done is not None:
                on_done()
            raise
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        deadline = now + timeout_s if timeout_s is not None else float("inf")
        job = _Job(list(texts), key, k, filter, with_text, loop.create_future(), loop, now, deadline, on_done,
                   tokens=list(tokens) if tokens is not None else None, vectors_only=vectors_only)
        with self._count_lock:
            self._live.add(job)
        self._q.put(job)
        return await self._wait(job.future, deadline)

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
            item = carry if carry is not None else self._q.get()
            carry = None
            if item is _STOP:
                break
            try:
                if isinstance(item, _Call):
                    self._do_call(item)
                    continue
                batch = [self._first_slice(item)]
                rows, longest = batch[0].hi - batch[0].lo, self._longest(batch[0])
                # Adaptive window: after a batch of one (no concurrency), waiting only adds
                # latency, so take what is already queued and go; under load batches hold
                # several requests and the window lets more join.
                window = self.window_s if (self._last_requests > 1 or not self.adaptive) else 0.0
                deadline = item.enqueued + window
                while rows < self.max_batch:
                    wait = deadline - time.perf_counter()
                    try:
                        nxt = self._q.get(timeout=wait) if wait > 0 else self._q.get_nowait()
                    except queue.Empty:
                        break
                    # Only whole requests join a batch; the first one is the one that is split.
                    if not isinstance(nxt, _Job) or nxt.next_row or rows + len(nxt.texts) > self.max_batch:
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
        self._drain()

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
        """The next rows of ``job`` that fit one batch (at least one row)."""
        try:
            self._counted(job)
        except Exception:   # a tokenizer failure: every row costs one; the encode reports the error
            job.tokens = [1] * len(job.texts)
        assert job.tokens is not None
        lo = job.next_row
        _, n = token_slices(job.tokens[lo:], self.slice_tokens, self.max_batch)[0]
        return _Slice(job, lo, lo + n)

    def _drain(self) -> None:
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
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

    def _process(self, batch: list[_Slice]) -> None:
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
            self._run_batch(live, start)
        finally:
            for sl in live:
                j = sl.job
                if j.next_row < len(j.texts) and not j.failed:
                    self._q.put(j)   # its next micro-batch waits behind the requests queued meanwhile
                else:
                    self._finish(j)

    def _encode_slices(self, slices: list[_Slice]) -> bool:
        """Encode the rows of ``slices`` into their jobs; False when the encode failed (posted)."""
        texts = [t for sl in slices for t in sl.job.texts[sl.lo:sl.hi]]
        keys = [sl.job.key for sl in slices for _ in range(sl.lo, sl.hi)]
        t0 = time.perf_counter()
        try:
            if self._encode_flagged is not None:
                emb, trunc = self._encode_flagged(texts, keys)
            else:
                trunc = self._truncated(texts) if self._truncated else [False] * len(texts)
                emb = self._encode(texts, keys)
        except Exception as e:
            if len(slices) > 1:
                # One bad row must not fail its neighbours: retry each request alone.
                return all([self._encode_slices([sl]) for sl in slices])
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

    def _run_batch(self, slices: list[_Slice], start: float) -> None:
        """Encode the slices; search (one call per distinct filter) the requests they complete."""
        self._encode_slices(slices)
        jobs = [sl.job for sl in slices if sl.job.next_row == len(sl.job.texts) and not sl.job.failed]
        if not jobs:
            return
        emb = np.concatenate([p for j in jobs for p in j.parts])
        offsets, o = [], 0
        for j in jobs:
            offsets.append(o)
            o += len(j.texts)
        groups: dict[str, list[int]] = {}
        m = self.metrics
        for i, j in enumerate(jobs):
            if j.vectors_only:   # an embedding request: its rows are its answer
                off, n = offsets[i], len(j.texts)
                queue_s = max(0.0, (j.started or start) - j.enqueued)
                if m is not None:
                    m.queue_seconds.observe(queue_s)
                _post(j.loop, j.future, EmbedOutcome(np.array(emb[off:off + n], dtype=np.float32),
                                                     list(j.trunc), queue_s, j.encode_s))
                j.parts.clear()
            else:
                groups.setdefault(json.dumps(j.filter, sort_keys=True, default=str), []).append(i)
        for members in groups.values():
            rows = [offsets[i] + r for i in members for r in range(len(jobs[i].texts))]
            kmax = max(jobs[i].k for i in members)
            with_text = any(jobs[i].with_text for i in members)
            t0 = time.perf_counter()
            try:
                hits = self._search(np.ascontiguousarray(emb[rows]), kmax, jobs[members[0]].filter, with_text)
            except Exception as e:
                for i in members:
                    _post(jobs[i].loop, jobs[i].future, exc=e)
                continue
            search_s = time.perf_counter() - t0
            if m is not None:
                m.search_seconds.observe(search_s)
            pos = 0
            for i in members:
                j = jobs[i]
                n = len(j.texts)
                queue_s = max(0.0, (j.started or start) - j.enqueued)
                if m is not None:
                    m.queue_seconds.observe(queue_s)
                _post(j.loop, j.future, SearchOutcome(
                    hits=[list(h[:j.k]) for h in hits[pos:pos + n]], truncated=list(j.trunc),
                    queue_s=queue_s, encode_s=j.encode_s, search_s=search_s, batch_requests=len(slices)))
                j.parts.clear()
                pos += n

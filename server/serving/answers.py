"""The last stage of the serving pipeline: search the index for encoded requests, post the answers.

The batch worker (:mod:`qswap.server.serving.batching`) hands each micro-batch's finished requests
here and goes on to the next forward pass while this stage searches (one index call per distinct
filter; FAISS releases the GIL) and builds the answers, so a batch's search overlaps the next
batch's forward instead of following it. Answers go back to the requests' event loops with
:func:`post`, or a batch's together with :class:`Posts`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

SearchFn = Callable[[np.ndarray, int, "dict[str, Any] | None", bool], list[list[Any]]]


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


def _resolve(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def post(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any = None,
         exc: BaseException | None = None) -> None:
    """Resolve ``fut`` on its event loop from any thread (nothing if the loop is closed or the
    future already done: its caller stopped waiting)."""
    try:
        loop.call_soon_threadsafe(_resolve, fut, result, exc)
    except RuntimeError:   # the loop is closed: nobody waits any more
        pass


def _resolve_all(answers: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for fut, result, exc in answers:
        _resolve(fut, result, exc)


class Posts:
    """Answers collected on a worker thread and handed to their event loops together: one
    ``call_soon_threadsafe`` (a wake-up of the loop: a write to its self-pipe, a callback) per
    loop and flush, not one per request."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any, BaseException | None]]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any = None,
            exc: BaseException | None = None) -> None:
        """Queue ``fut``'s answer (sent at the next :meth:`flush`)."""
        self._by_loop.setdefault(loop, []).append((fut, result, exc))

    def flush(self) -> None:
        """Send what was queued, as :func:`post` would (a closed loop's answers are dropped)."""
        by_loop, self._by_loop = self._by_loop, {}
        for loop, answers in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve_all, answers)
            except RuntimeError:   # the loop is closed: nobody waits any more
                pass


def answer_batch(jobs: list[Any], batch_requests: int, start: float, search: SearchFn, metrics: Any) -> None:
    """Answer requests whose rows are all encoded: embeddings as they are, searches by filter.

    Args:
        jobs: the batcher's jobs (``texts``, ``parts``, ``trunc``, ``k``, ``filter``, ``with_text``,
            ``vectors_only``, ``loop``, ``future``, ``enqueued``, ``started``, ``encode_s``).
        batch_requests: requests in the micro-batch that completed them (reported per answer).
        start: when that micro-batch started (for requests that never started before it).
        search: ``search(vectors, k, filter, with_text) -> hits per row``.
        metrics: the server's metrics, or None.
    """
    emb = np.concatenate([p for j in jobs for p in j.parts])
    offsets, o = [], 0
    for j in jobs:
        offsets.append(o)
        o += len(j.texts)
    groups: dict[str | None, list[int]] = {}
    posts = Posts()   # sent once the embeddings are ready, then once per filter group searched
    for i, j in enumerate(jobs):
        if j.vectors_only:   # an embedding request: its rows are its answer
            off, n = offsets[i], len(j.texts)
            queue_s = _queued(j, start, metrics)
            posts.add(j.loop, j.future, EmbedOutcome(np.array(emb[off:off + n], dtype=np.float32), list(j.trunc), queue_s,
                                                j.encode_s))
            j.parts.clear()
        else:   # one key per distinct filter (most searches have none: no JSON to write)
            key = None if j.filter is None else json.dumps(j.filter, sort_keys=True, default=str)
            groups.setdefault(key, []).append(i)
    posts.flush()
    for members in groups.values():
        rows = [offsets[i] + r for i in members for r in range(len(jobs[i].texts))]
        kmax = max(jobs[i].k for i in members)
        with_text = any(jobs[i].with_text for i in members)
        t0 = time.perf_counter()
        try:
            q = emb if len(rows) == len(emb) else np.ascontiguousarray(emb[rows])   # rows: all, in order
            hits = search(q, kmax, jobs[members[0]].filter, with_text)
        except Exception as e:
            for i in members:
                posts.add(jobs[i].loop, jobs[i].future, exc=e)
            posts.flush()
            continue
        search_s = time.perf_counter() - t0
        if metrics is not None:
            metrics.search_seconds.observe(search_s)
        pos = 0
        for i in members:
            j = jobs[i]
            n = len(j.texts)
            posts.add(j.loop, j.future, SearchOutcome(
                hits=[list(h[:j.k]) for h in hits[pos:pos + n]], truncated=list(j.trunc),
                queue_s=_queued(j, start, metrics), encode_s=j.encode_s, search_s=search_s,
                batch_requests=batch_requests))
            j.parts.clear()
            pos += n
        posts.flush()


def _queued(job: Any, start: float, metrics: Any) -> float:
    queue_s = max(0.0, (job.started or start) - job.enqueued)
    if metrics is not None:
        metrics.queue_seconds.observe(queue_s)
    return queue_s

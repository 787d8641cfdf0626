"""server/serving/batching.py: micro-batches, the adaptive window, failure isolation, admission and deadlines."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from contextlib import contextmanager
import threading
import time

import numpy as np
import pytest

from qswap.errors import DeadlineExceededError, InvalidInputError, OverloadedError
from qswap.server.serving.admission import Ticket
from qswap.server.serving.batching import MicroBatcher


def _fake(calls: list, fail_key: str | None = None):
    def encode(texts, keys):
        calls.append(("encode", list(texts), list(keys), threading.current_thread().name))
        if fail_key in keys:
            raise InvalidInputError(f"bad key {fail_key}")
        # row i -> a vector that encodes which text it was: search returns it as the hit id
        return np.array([[float(len(t)), float(hash(k) % 7)] for t, k in zip(texts, keys)], dtype=np.float32)

    def search(q, k, flt, with_text):
        calls.append(("search", len(q), k, flt))
        return [[f"{int(row[0])}:{r}" for r in range(k)] for row in q]
    return encode, search


@contextmanager
def running(**kw) -> Iterator[MicroBatcher]:
    """A started batcher, stopped at the end of the block."""
    b = MicroBatcher(**kw)
    b.start()
    try:
        yield b
    finally:
        b.stop()


def _run(coro):
    return asyncio.run(coro)


def test_batcher_merges_concurrent_requests_into_one_pass():
    calls: list = []
    enc, srch = _fake(calls)
    with running(encode=enc, search=srch, window_s=0.2, max_batch=64, adaptive=False) as b:
        async def main():
            texts = [["a" * (i + 1)] * (1 + i % 2) for i in range(10)]
            outs = await asyncio.gather(*[b.search(t, f"k{i % 3}", k=2 + i % 3, ticket=Ticket()) for i, t in enumerate(texts)])
            return texts, outs, threading.current_thread().name
        texts, outs, loop_thread = _run(main())
    encodes = [c for c in calls if c[0] == "encode"]
    searches = [c for c in calls if c[0] == "search"]
    assert len(encodes) == 1 and len(encodes[0][1]) == sum(len(t) for t in texts)
    assert len(searches) == 1 and searches[0][2] == 4            # one call, largest k of the group
    assert encodes[0][3] == "qswap-batcher" != loop_thread       # model code never on the event loop
    for i, (t, out) in enumerate(zip(texts, outs)):
        assert len(out.hits) == len(t)
        assert all(len(h) == 2 + i % 3 for h in out.hits)        # each request gets its own k
        assert all(h[0].startswith(f"{len(t[0])}:") for h in out.hits)  # and its own rows
        assert out.batch_requests == 10


@pytest.mark.serial
def test_batcher_adaptive_window_skips_the_wait_when_idle():
    """A lone request is not held for the window; under load the window batches again."""
    calls: list = []
    enc, srch = _fake(calls)
    with running(encode=enc, search=srch, window_s=0.5, max_batch=64) as b:
        async def lone():
            t0 = time.perf_counter()
            await b.search(["x"], "k", k=1, ticket=Ticket())
            return time.perf_counter() - t0
        assert _run(lone()) < 0.25                    # did not wait the 0.5 s window
        b._last_requests = 2                          # as after a batch of several requests
        async def burst():
            return await asyncio.gather(*[b.search(["y"], "k", k=1, ticket=Ticket()) for _ in range(5)])
        outs = _run(burst())
    assert all(o.batch_requests == 5 for o in outs)   # the window collected the whole burst


def test_batcher_isolates_failures(caplog):
    calls: list = []
    enc, srch = _fake(calls, fail_key="bad")
    done: list[str] = []
    with running(encode=enc, search=srch, window_s=0.2, max_batch=64, adaptive=False) as b:
        async def main():
            return await asyncio.gather(
                b.search(["x"], "good", 1, {"s": "a"}, on_done=lambda: done.append("1"), ticket=Ticket()),
                b.search(["yy"], "bad", 1, on_done=lambda: done.append("2"), ticket=Ticket()),
                b.search(["zzz"], "good", 1, {"s": "b"}, on_done=lambda: done.append("3"), ticket=Ticket()),
                b.search(["w"], "good", 1, {"s": "a"}, on_done=lambda: done.append("4"), ticket=Ticket()),
                return_exceptions=True)
        outs = _run(main())
    assert isinstance(outs[1], InvalidInputError)
    assert [o.hits[0][0] for o in (outs[0], outs[2], outs[3])] == ["1:0", "3:0", "1:0"]
    assert sorted(done) == ["1", "2", "3", "4"]                 # every reference released once
    assert "a forward pass of 4 requests failed (InvalidInputError" in caplog.text   # said, not silent


def test_batcher_one_search_per_distinct_filter():
    calls: list = []
    enc, srch = _fake(calls)
    with running(encode=enc, search=srch, window_s=0.2, max_batch=64, adaptive=False) as b:
        async def main():
            return await asyncio.gather(b.search(["x"], "k", 1, {"s": "a"}, ticket=Ticket()), b.search(["yy"], "k", 3, {"s": "b"}, ticket=Ticket()),
                                        b.search(["zzz"], "k", 2, {"s": "a"}, ticket=Ticket()))
        outs = _run(main())
    assert len([c for c in calls if c[0] == "encode"]) == 1
    assert sorted((str(c[3]), c[1], c[2]) for c in calls if c[0] == "search") == [
        ("{'s': 'a'}", 2, 2), ("{'s': 'b'}", 1, 3)]
    assert [len(o.hits[0]) for o in outs] == [1, 3, 2]


def test_batcher_searches_on_one_openmp_thread():
    """The answer stage runs beside the next forward pass: FAISS must not spread its searches
    over the cores that pass holds (its OpenMP threads are a setting of the calling thread)."""
    import faiss

    seen: list[int] = []
    control: list[int] = []
    enc, _ = _fake([])

    def search(q, k, flt, with_text):
        seen.append(faiss.omp_get_max_threads())
        return [[] for _ in q]
    t = threading.Thread(target=lambda: control.append(faiss.omp_get_max_threads()))
    t.start()
    t.join()
    if control[0] < 2:
        pytest.skip("one OpenMP thread is this machine's default: nothing to limit")
    with running(encode=enc, search=search, adaptive=False) as b:
        _run(b.search(["x", "yy"], "k", 2, ticket=Ticket()))
    assert seen == [1]


def test_batcher_respects_max_batch_and_runs_calls_on_the_writes_thread():
    calls: list = []
    enc, srch = _fake(calls)
    with running(encode=enc, search=srch, window_s=0.2, max_batch=4, adaptive=False) as b:
        async def main():
            outs = await asyncio.gather(*[b.search(["q"] * 3, "k", 1, ticket=Ticket()) for _ in range(4)])
            name = await b.call(lambda: threading.current_thread().name)
            return outs, name
        outs, name = _run(main())
    assert name == "qswap-batcher-writes"
    assert all(len(c[1]) <= 4 for c in calls if c[0] == "encode")
    assert sum(len(c[1]) for c in calls if c[0] == "encode") == 12 and len(outs) == 4


def test_a_search_is_answered_while_an_index_write_runs():
    """An index write (an upsert's commit) holds neither the forward pass nor the answers: a
    search submitted while one runs is answered before it ends; writes run one at a time, in order."""
    calls: list = []
    enc, srch = _fake(calls)
    inside, release = threading.Event(), threading.Event()
    order: list[str] = []

    def write(name: str) -> str:
        order.append(f"{name} start")
        if name == "first":
            inside.set()
            assert release.wait(60)
        order.append(f"{name} end")
        return name

    with running(encode=enc, search=srch, window_s=0.0, max_batch=4) as b:
        async def main():
            first = asyncio.ensure_future(b.call(write, "first"))
            try:
                assert await asyncio.to_thread(inside.wait, 30)          # the write is running
                second = asyncio.ensure_future(b.call(write, "second"))
                out = await asyncio.wait_for(b.search(["q"], "k", 1, ticket=Ticket()), 10)
                assert not first.done() and not second.done()
            finally:
                release.set()
            return out, await first, await second
        out, *names = _run(main())
    assert out.hits and names == ["first", "second"]
    assert order == ["first start", "first end", "second start", "second end"]


def test_batcher_admission_limits_and_deadlines():
    release = threading.Event()
    entered = threading.Event()
    finished = {name: threading.Event() for name in ("first", "queued", "other")}

    def encode(texts, keys):
        entered.set()
        release.wait(5)
        return np.zeros((len(texts), 2), dtype=np.float32)

    def search(q, k, flt, with_text):
        return [[] for _ in q]

    async def main():
        b = MicroBatcher(encode=encode, search=search, window_s=0.0, max_batch=1, max_pending=3,
                         max_pending_per_encoder=2)
        b.start()
        first = asyncio.ensure_future(b.search(["a"], "e1", 1, on_done=finished["first"].set, ticket=Ticket()))
        assert await asyncio.to_thread(entered.wait, 10)                 # first runs, blocked in encode
        queued = asyncio.ensure_future(b.search(["b"], "e1", 1, ticket=Ticket(0.1),     # waits, expires
                                                on_done=finished["queued"].set))
        await asyncio.sleep(0)                                           # let it be admitted (no time passes)
        with pytest.raises(OverloadedError):                             # e1 has 2 admitted
            await b.search(["c"], "e1", 1, ticket=Ticket())
        other = asyncio.ensure_future(b.search(["d"], "e2", 1, on_done=finished["other"].set, ticket=Ticket()))  # overall 3 of 3
        await asyncio.sleep(0)
        with pytest.raises(OverloadedError):
            await b.search(["e"], "e3", 1, ticket=Ticket())
        with pytest.raises(DeadlineExceededError):
            await queued
        release.set()
        await first
        await other
        for name, done in finished.items():                             # each job's count released
            assert await asyncio.to_thread(done.wait, 10), name
        assert b.pending == 0                                            # the dropped job left the count
        await b.search(["f"], "e1", 1, ticket=Ticket())
        b.drain()
        with pytest.raises(Exception, match="shutting down"):
            await b.search(["g"], "e1", 1, ticket=Ticket())
        b.stop()
    _run(main())


def test_a_cancelled_caller_is_cancelled_not_timed_out():
    """A request with a deadline whose caller is cancelled (its client went away) ends cancelled,
    not as a 504, and its job leaves the admission count."""
    release, entered, finished = threading.Event(), threading.Event(), threading.Event()

    def encode(texts, keys):
        entered.set()
        release.wait(5)
        return np.zeros((len(texts), 2), dtype=np.float32)

    async def main():
        b = MicroBatcher(encode=encode, search=lambda q, k, f, t: [[] for _ in q], window_s=0.0)
        b.start()
        try:
            task = asyncio.ensure_future(b.search(["a"], "e1", 1, on_done=finished.set, ticket=Ticket(30.0)))
            assert await asyncio.to_thread(entered.wait, 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            release.set()
            assert await asyncio.to_thread(finished.wait, 10)
            assert b.pending == 0
        finally:
            release.set()
            b.stop()
    _run(main())


def test_pipeline_answers_one_batch_while_the_next_is_encoded():
    """Under concurrency, tokens are counted on their own thread, and a batch's search runs on the
    answer thread while the forward thread encodes the next batch (held until then: without the
    overlap the search gives up after 10 s and the answer says so). The first request's forward
    pass is held until the second request is counted, so the first batch does not end idle."""
    first_encoded, second_counted, second_encoded = threading.Event(), threading.Event(), threading.Event()
    names: dict[str, str] = {}

    def count(texts):
        names[f"count {texts[0]}"] = threading.current_thread().name
        if texts == ["b"]:
            second_counted.set()
        return [1] * len(texts)

    def encode(texts, keys):
        names.setdefault("encode", threading.current_thread().name)
        if first_encoded.is_set():
            second_encoded.set()
        else:
            first_encoded.set()
            assert second_counted.wait(10)   # a second request admitted: this batch is not idle
        return np.ones((len(texts), 2), dtype=np.float32)

    def search(q, k, flt, with_text):
        names.setdefault("search", threading.current_thread().name)
        overlapped = second_encoded.wait(10)
        return [[overlapped] * k for _ in q]

    with running(encode=encode, search=search, count_tokens=count, window_s=0.0, max_batch=64) as b:
        async def main():
            first = asyncio.ensure_future(b.search(["a"], "k", 1, ticket=Ticket()))
            assert await asyncio.to_thread(first_encoded.wait, 10)   # batch 1 encoding, held
            second = await b.search(["b"], "k", 1, ticket=Ticket())
            return await first, second
        first, second = _run(main())
    assert first.hits == [[True]] and second.hits == [[True]]
    assert names == {"count a": "qswap-batcher",   # admitted alone: tokenised on the forward thread
                     "count b": "qswap-batcher-tokens", "encode": "qswap-batcher", "search": "qswap-batcher-answers"}


def test_a_lone_request_is_answered_on_the_forward_thread():
    """With nothing else admitted, a request is counted, encoded and searched on the forward
    thread: no hand-off to the tokens or the answer stage."""
    names: list[tuple[str, str]] = []

    def count(texts):
        names.append(("count", threading.current_thread().name))
        return [1] * len(texts)

    enc, srch = _fake([])

    def search(q, k, flt, with_text):
        names.append(("search", threading.current_thread().name))
        return srch(q, k, flt, with_text)

    with running(encode=enc, search=search, count_tokens=count, window_s=0.0) as b:
        async def main():
            outs = []
            for n in (1, 2):
                done = threading.Event()   # set once the request is finished (no longer admitted)
                outs.append(await b.search(["x" * n], "k", 2, on_done=done.set, ticket=Ticket()))
                assert await asyncio.to_thread(done.wait, 10)
            return outs
        outs = _run(main())
    assert [o.hits for o in outs] == [[["1:0", "1:1"]], [["2:0", "2:1"]]]
    assert names == [("count", "qswap-batcher"), ("search", "qswap-batcher")] * 2


def _short_beside_held_large(encode, search, held: threading.Event, release: threading.Event):
    """On a batcher with the bulk lane (slices of 8 tokens), send a large request (3 rows of 60
    characters: 7 tokens each), wait until ``held`` says a fake holds it, then send a one-query
    search: it must be answered while the large request is not done. Returns (short, big)."""
    with running(encode=encode, search=search, bulk=True, max_batch_tokens=64, slice_tokens=8,
                 count_tokens=lambda texts: [len(t) // 10 + 1 for t in texts]) as b:
        async def main():
            big = asyncio.ensure_future(b.search(["L" * 60] * 3, "k", k=1, ticket=Ticket()))
            assert await asyncio.to_thread(held.wait, 30)
            short = await asyncio.wait_for(b.search(["short"], "k", k=1, ticket=Ticket()), 10)
            assert not big.done()                      # the large request is still held
            release.set()
            return short, await asyncio.wait_for(big, 30)
        try:
            return _run(main())
        finally:
            release.set()


def test_bulk_lane_answers_a_short_search_while_a_large_request_runs():
    # A request over slice_tokens runs on the bulk lane: a one-query search arriving while one
    # of its slices is in the model is answered at once, not after that slice. Without the lane
    # the short search would wait for the held slice (this test would time out).
    held, release = threading.Event(), threading.Event()
    lanes: list[str] = []

    def encode(texts, keys):
        lanes.append(threading.current_thread().name)
        if any(len(t) > 50 for t in texts):
            held.set()
            assert release.wait(30), "never released"
        return np.array([[float(len(t)), 0.0] for t in texts], dtype=np.float32)

    def search(q, k, flt, with_text):
        return [[f"{int(row[0])}:{r}" for r in range(k)] for row in q]

    short, big = _short_beside_held_large(encode, search, held, release)
    assert short.hits[0][0].startswith("5:") and [h[0] for h in big.hits] == ["60:0"] * 3
    assert "qswap-batcher-bulk" in lanes and "qswap-batcher" in lanes
    assert lanes.count("qswap-batcher-bulk") == 3    # one 7-token row per slice of 8 tokens


def test_bulk_lane_off_keeps_one_forward_thread():
    calls: list = []
    enc, srch = _fake(calls)
    with running(encode=enc, search=srch, max_batch_tokens=64, slice_tokens=8,
                 count_tokens=lambda texts: [len(t) // 10 + 1 for t in texts]) as b:
        _run(b.search(["L" * 60] * 3, "k", k=1, ticket=Ticket()))
    assert {c[3] for c in calls if c[0] == "encode"} == {"qswap-batcher"}


def test_a_large_request_is_tokenised_on_the_low_priority_thread_itself(monkeypatch):
    # The bulk lane's tokenising thread runs at nice 19; the tokenizer's own thread pool (rayon,
    # made by the first thread that tokenises, at its normal priority) must not do that work for
    # it. Measured: the CPU time of the low thread against the whole process's during the call
    # (without tokenize_on_caller the pool's threads take all of it and the thread ~none).
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = [f"w{i}" for i in range(1000)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    texts = [" ".join(words[(i + j) % 1000] for j in range(4000)) for i in range(64)]
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")   # as in a process that never turned it off
    tok.encode_batch(texts[:2])                            # the pool is made here, on a normal thread

    def tokenize() -> tuple[float, float]:
        own, total = time.thread_time(), time.process_time()
        tok.encode_batch(texts)
        return time.thread_time() - own, time.process_time() - total

    calls: list = []
    enc, srch = _fake(calls)
    with running(encode=enc, search=srch, bulk=True) as b:
        own, total = _run(b.low_priority(tokenize))
    assert total > 0 and own >= 0.7 * total, (own, total)


def test_a_large_requests_answer_is_made_beside_the_small_ones_on_the_idle_priority_lane():
    # The bulk lane's requests are answered on a thread of their own: a one-query search is
    # answered while a large request's index search (its texts fetched, its hits built) is still
    # running. On a shared answer thread it would wait behind it (this test would time out).
    # The bulk lane's forward thread runs under SCHED_IDLE (Linux).
    held, release = threading.Event(), threading.Event()
    policies: list[int] = []

    def encode(texts, keys):
        if "L" in texts[0] and hasattr(os, "sched_getscheduler"):
            policies.append(os.sched_getscheduler(0))   # 0: the calling thread
        return np.array([[float(len(t)), 0.0] for t in texts], dtype=np.float32)

    def search(q, k, flt, with_text):
        if len(q) > 1:
            held.set()
            assert release.wait(30), "never released"
        return [[f"{int(row[0])}:{r}" for r in range(k)] for row in q]

    short, big = _short_beside_held_large(encode, search, held, release)
    assert short.hits[0][0].startswith("5:") and [h[0] for h in big.hits] == ["60:0"] * 3
    if hasattr(os, "SCHED_IDLE"):
        assert policies and set(policies) == {os.SCHED_IDLE}


def test_a_second_lane_encodes_on_one_core_while_the_first_lane_is_busy():
    # lanes=2: a batch that starts while another lane is encoding runs at once, on one core
    # (encode_single), instead of waiting for the first. With one lane the second search waits
    # for the held batch and the wait_for below fails.
    held, release = threading.Event(), threading.Event()
    seen: list[tuple[str, str, str]] = []   # (path, text, thread)

    def encode(texts, keys):
        seen.append(("all cores", texts[0], threading.current_thread().name))
        if texts[0] == "first":
            held.set()
            assert release.wait(30), "never released"
        return np.ones((len(texts), 2), dtype=np.float32)

    def single(texts, keys):
        seen.append(("one core", texts[0], threading.current_thread().name))
        return np.ones((len(texts), 2), dtype=np.float32), [False] * len(texts)

    def search(q, k, flt, with_text):
        return [["hit"] * k for _ in q]

    with running(encode=encode, search=search, window_s=0.0, lanes=2, encode_single=single) as b:
        async def main():
            first = asyncio.ensure_future(b.search(["first"], "k1", 1, ticket=Ticket()))
            assert await asyncio.to_thread(held.wait, 30)
            second = await asyncio.wait_for(b.search(["second"], "k2", 1, ticket=Ticket()), 10)
            assert not first.done()   # still in its held pass
            release.set()
            return await asyncio.wait_for(first, 30), second
        try:
            first, second = _run(main())
        finally:
            release.set()
    assert first.hits == [["hit"]] and second.hits == [["hit"]]
    assert [(p, t) for p, t, _ in seen] == [("all cores", "first"), ("one core", "second")]
    assert seen[0][2] != seen[1][2]   # two forward threads


def test_a_lane_beside_a_busy_one_takes_at_most_half_of_the_waiting_requests():
    # Both lanes held ("first" on all cores, "second" on one core), five searches wait. Released, the
    # first lane starts beside the still busy second: its one-core batch takes three of the five
    # (half, rounded up), then one at a time while the other is busy. Taking all it could, it would
    # run one batch of five (the assertion on the batch sizes fails).
    held = {"first": threading.Event(), "second": threading.Event()}
    release = {"first": threading.Event(), "second": threading.Event()}
    seen: list[tuple[str, int]] = []

    def hold(texts):
        if texts[0] in held:
            held[texts[0]].set()
            assert release[texts[0]].wait(30), "never released"

    def encode(texts, keys):
        seen.append(("all cores", len(texts)))
        hold(texts)
        return np.ones((len(texts), 2), dtype=np.float32)

    def single(texts, keys):
        seen.append(("one core", len(texts)))
        hold(texts)
        return np.ones((len(texts), 2), dtype=np.float32), [False] * len(texts)

    def search(q, k, flt, with_text):
        return [["hit"] * k for _ in q]

    with running(encode=encode, search=search, window_s=0.0, lanes=2, encode_single=single) as b:
        async def main():
            first = asyncio.ensure_future(b.search(["first"], "k", 1, ticket=Ticket()))
            assert await asyncio.to_thread(held["first"].wait, 30)
            second = asyncio.ensure_future(b.search(["second"], "k", 1, ticket=Ticket()))
            assert await asyncio.to_thread(held["second"].wait, 30)
            waiting = [asyncio.ensure_future(b.search([f"q{i}"], "k", 1, ticket=Ticket())) for i in range(5)]
            end = time.monotonic() + 30
            while b._ready.qsize() < 5:   # all five counted and queued for the lanes
                assert time.monotonic() < end, "never queued"
                await asyncio.sleep(0.001)
            release["first"].set()
            done = await asyncio.wait_for(asyncio.gather(first, *waiting), 30)
            assert not second.done()
            release["second"].set()
            return done, await asyncio.wait_for(second, 30)
        try:
            done, second = _run(main())
        finally:
            for e in release.values():
                e.set()
    assert all(r.hits == [["hit"]] for r in [*done, second])
    assert seen == [("all cores", 1), ("one core", 1), ("one core", 3), ("one core", 1), ("one core", 1)]


def test_lanes_run_one_request_at_a_time_on_all_cores_and_stop_with_the_batcher():
    # Without concurrency only one lane is busy at a time: every pass takes the all-cores path.
    # stop() ends every lane (none left waiting on the queue).
    calls: list = []
    enc, srch = _fake(calls)
    singles: list = []

    def single(texts, keys):
        singles.append(list(texts))
        return enc(texts, keys), [False] * len(texts)

    b = MicroBatcher(encode=enc, search=srch, window_s=0.0, lanes=3, encode_single=single)
    b.start()
    try:
        for i in range(5):
            out = _run(b.search(["x" * (i + 1)], "k", k=1, ticket=Ticket()))
            assert out.hits[0][0] == f"{i + 1}:0"
    finally:
        b.stop()
    assert not singles and len([c for c in calls if c[0] == "encode"]) == 5
    assert b.lanes == 3 and not b.thread.is_alive() and not any(t.is_alive() for t in b._lanes)


def test_lanes_need_a_single_core_encode():
    # A backend without a single-threaded session (encode_single None) gets one forward lane:
    # two calls at once on a session that uses every core would fight over its threads.
    enc, srch = _fake([])
    assert MicroBatcher(encode=enc, search=srch, lanes=2).lanes == 1
    with pytest.raises(ValueError):
        MicroBatcher(encode=enc, search=srch, lanes=0)

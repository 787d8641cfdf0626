"""Hot encoders: an encoder serving most of a server's rows runs on its own merged graph, with
the same answers, and goes back to the shared graph (its session freed) when its traffic falls."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from qswap.encoders import BASE_KEY, EncoderPool, load_encoder
from qswap.encoders.runtime.hot import DEFAULT_HOT, FEW_DOMAINS_HOT, HOT_SHARE, HotEncoders, hot_share
from qswap.encoders.runtime.protocol import served, served_single
from qswap.encoders.runtime.shared import SharedBackend
from qswap.errors import InvalidInputError
from qswap.server.serving.admission import Ticket
from qswap.server.serving.batching import MicroBatcher

from .adapters import make_lora
from .test_shared import MIN_COSINE, TEXTS, cosine

ALL = lambda key: True   # noqa: E731 - every key may run merged


def test_an_encoder_with_most_rows_becomes_hot_at_the_end_of_a_window():
    hot = HotEncoders(slots=1, window=10)
    assert hot.count(["a"] * 6, ALL) == ([], [])          # the window is not full yet
    assert hot.count(["b"] * 4, ALL) == (["a"], [])       # a: 60 % of 10 rows
    assert "a" in hot and hot.keys() == {"a"}


def test_even_traffic_over_more_than_twice_the_slots_makes_no_encoder_hot():
    hot = HotEncoders(slots=2, window=10)
    assert hot.count(["a", "b", "c", "d", "e"] * 2, ALL) == ([], [])   # 20 % each < hot_share(2) = 25 %
    assert hot.keys() == set()


def test_four_equal_domains_are_none_hot_by_default_and_all_hot_with_four_slots():
    # The default keeps one merged session: for the encoder with half the rows, not for one of four.
    assert HotEncoders(window=16).count(["a", "b", "c", "d"] * 4, ALL) == ([], [])
    assert DEFAULT_HOT == 1 and FEW_DOMAINS_HOT == 4 and hot_share(FEW_DOMAINS_HOT) <= 0.25
    hot = HotEncoders(slots=FEW_DOMAINS_HOT, window=16)
    assert hot.count(["a", "b", "c", "d"] * 4, ALL) == (["a", "b", "c", "d"], [])
    assert hot.keys() == {"a", "b", "c", "d"}
    assert hot.count(["a", "b", "c", "d"] * 4, ALL) == ([], [])          # still equal: nothing changes


def test_the_slot_limit_takes_the_busiest_and_a_freed_slot_goes_to_the_next():
    hot = HotEncoders(slots=2, window=20)
    # 35 / 30 / 20 / 15 %: a and b reach hot_share(2) = 25 %, c and d do not
    assert hot.count(["a"] * 7 + ["b"] * 6 + ["c"] * 4 + ["d"] * 3, ALL) == (["a", "b"], [])
    # b falls to 10 % (< half its line): demoted; c at 40 % takes its slot, d (20 %) stays out
    assert hot.count(["a"] * 6 + ["b"] * 2 + ["c"] * 8 + ["d"] * 4, ALL) == (["c"], ["b"])
    assert hot.keys() == {"a", "c"}


def test_a_hot_encoder_of_several_keeps_its_slot_down_to_half_its_line():
    hot = HotEncoders(slots=4, window=16)
    hot.count(["a", "b", "c", "d"] * 4, ALL)
    line = hot_share(4)
    # a at 1/16 = 6.25 % is exactly half the line: kept; e (25 %) finds no slot free
    assert hot.count(["a"] + ["b"] * 4 + ["c"] * 4 + ["d"] * 3 + ["e"] * 4, ALL) == ([], [])
    assert 1 / 16 >= line / 2
    # a gone (0 %): its slot goes to e
    assert hot.count(["b", "c", "d", "e"] * 4, ALL) == (["e"], ["a"])


def test_a_hot_encoder_stays_hot_above_half_the_share_and_leaves_below():
    hot = HotEncoders(slots=1, window=10)
    hot.count(["a"] * 10, ALL)
    assert hot.count(["a"] * 3 + ["b"] * 7, ALL) == ([], [])      # 30 % >= HOT_SHARE / 2: kept
    assert HOT_SHARE / 2 <= 0.3 < HOT_SHARE
    assert hot.count(["a"] * 2 + ["b"] * 8, ALL) == (["b"], ["a"])  # 20 %: gone, b takes the slot


def test_no_slot_no_hot_encoder_and_ineligible_keys_are_skipped():
    off = HotEncoders(slots=0, window=1)
    assert off.count(["a"] * 5, ALL) == ([], []) and off.keys() == set()
    hot = HotEncoders(slots=1, window=4)
    assert hot.count(["partial"] * 4, lambda k: k != "partial") == ([], [])
    hot.count(["a"] * 4, ALL)
    assert hot.count(["a"] * 4, lambda k: False) == ([], ["a"])    # removed from the shared graph: not hot


def test_discard_forgets_the_key_and_its_rows():
    hot = HotEncoders(slots=1, window=4)
    hot.count(["a"] * 4, ALL)
    hot.count(["a"] * 3, ALL)
    assert hot.discard("a") and not hot.discard("a")
    assert hot.count(["b"], ALL) == ([], [])   # a's 3 rows no longer count towards the window


@pytest.mark.parametrize("slots, window", [(-1, 4), (1, 0)])
def test_bad_settings_are_refused(slots, window):
    with pytest.raises(InvalidInputError):
        HotEncoders(slots=slots, window=window)


@pytest.fixture(scope="module")
def pool(tiny_base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hot-enc")
    pool = EncoderPool(tiny_base, factor_dtype="float32")
    for name, seed in (("h1", 1), ("h2", 2)):
        pool.add(load_encoder(make_lora(tiny_base, tmp / name, name, seed=seed, r=4,
                                        targets=("query", "value", "dense")), tiny_base.space))
    return pool


@pytest.fixture
def backend(pool, tmp_path):
    b = SharedBackend(pool, tmp_path, threads=1, hot=1, hot_window=len(TEXTS))
    for key in ("h1@1", "h2@1", BASE_KEY):
        b.prepare(key)
    assert b.wait(timeout=120), b.error("h1@1")
    yield b
    b.close()


def _spy_merged(backend, monkeypatch) -> list[list[str]]:
    """The keys of every batch the merged sessions encode (the real method runs)."""
    calls: list[list[str]] = []
    encode = backend.merged.encode
    monkeypatch.setattr(backend.merged, "encode", lambda texts, keys, **kw: (calls.append(list(keys)),
                                                                             encode(texts, keys, **kw))[1])
    return calls


def test_served_rows_make_an_encoder_hot_and_its_rows_run_merged(backend, pool, monkeypatch):
    encode = served(backend)
    assert backend.runtime("h1@1") == "onnx-shared"
    encode(TEXTS, ["h1@1"] * len(TEXTS))                  # one window, all h1: hot
    assert backend.merged.wait("h1@1", timeout=120), backend.merged.error("h1@1")
    assert backend.runtime("h1@1") == "onnx-merged" and backend.hot() == ["h1@1"]
    assert backend.runtime("h2@1") == "onnx-shared"
    calls = _spy_merged(backend, monkeypatch)
    keys = ["h1@1", "h2@1", "h1@1", BASE_KEY, "h1@1", "h2@1", "h1@1", "h1@1", BASE_KEY]
    got = encode(TEXTS, keys)
    assert calls == [["h1@1"] * 5]                        # h1's rows, and only they, ran merged
    ref = np.stack([pool.encode([t], [k])[0] for t, k in zip(TEXTS, keys)])
    assert cosine(got, ref).min() >= MIN_COSINE


def test_the_bulk_lane_and_unserved_passes_never_use_the_merged_session(backend, monkeypatch):
    served(backend)(TEXTS, ["h1@1"] * len(TEXTS))
    assert backend.merged.wait("h1@1", timeout=120)
    calls = _spy_merged(backend, monkeypatch)
    backend.encode_flagged_bulk(TEXTS, ["h1@1"] * len(TEXTS))   # holds one core: the single-threaded session
    assert calls == []
    for _ in range(3):   # a guard or tuning pass: not counted, h1 stays the hot one
        backend.encode(TEXTS, ["h2@1"] * len(TEXTS))
    assert backend.hot() == ["h1@1"]


def test_a_cold_encoder_goes_back_to_the_shared_graph_and_frees_its_session(backend):
    encode = served(backend)
    encode(TEXTS, ["h1@1"] * len(TEXTS))
    assert backend.merged.wait("h1@1", timeout=120)
    encode(TEXTS, ["h2@1"] * len(TEXTS))                  # the next window is all h2
    assert backend.runtime("h1@1") == "onnx-shared" and not backend.merged.ready("h1@1")
    assert backend.merged.wait("h2@1", timeout=120)
    assert backend.hot() == ["h2@1"]


def test_a_removed_hot_encoder_is_forgotten(backend):
    served(backend)(TEXTS, ["h1@1"] * len(TEXTS))
    assert backend.merged.wait("h1@1", timeout=120)
    backend.discard("h1@1")
    assert backend.hot() == [] and not backend.merged.ready("h1@1")
    backend.prepare("h1@1")                               # registered again: shared until hot again
    assert backend.runtime("h1@1") == "onnx-shared"


def test_hot_off_keeps_every_encoder_on_the_shared_graph(pool, tmp_path):
    b = SharedBackend(pool, tmp_path, threads=1, hot=0, hot_window=1)
    try:
        b.prepare("h1@1")
        assert b.wait(timeout=120)
        served(b)(TEXTS, ["h1@1"] * len(TEXTS))
        assert b.hot() == [] and b.runtime("h1@1") == "onnx-shared"
    finally:
        b.close()


def test_a_second_forward_lanes_rows_count_and_run_on_one_core(backend, pool, monkeypatch):
    # served_single: a server's forward lane on one core (the single-threaded session while the
    # encoder is not hot); its rows count towards which encoder is hot like the first lane's.
    single = served_single(backend)
    assert single is not None
    calls = _spy_merged(backend, monkeypatch)
    got, flags = single(TEXTS, ["h1@1"] * len(TEXTS))     # one window, all h1: hot
    assert backend.merged.wait("h1@1", timeout=120)
    assert backend.hot() == ["h1@1"] and calls == [] and flags == [False] * len(TEXTS)
    ref = np.stack([pool.encode([t], ["h1@1"])[0] for t in TEXTS])
    assert cosine(got, ref).min() >= MIN_COSINE


@pytest.fixture
def two_threads(pool, tmp_path):
    """A backend whose sessions use two threads (a one-thread backend has no one-core twins), h1 hot."""
    b = SharedBackend(pool, tmp_path, threads=2, hot=1, hot_window=len(TEXTS))
    try:
        for key in ("h1@1", "h2@1"):
            b.prepare(key)
        assert b.wait(timeout=120), b.error("h1@1")
        served(b)(TEXTS, ["h1@1"] * len(TEXTS))           # one window, all h1: hot
        assert b.merged.wait("h1@1", timeout=120), b.merged.error("h1@1")
        yield b
    finally:
        b.close()


def _spy_run(session) -> list[int]:
    """One entry per run of the ONNX Runtime ``session`` (the real run happens)."""
    runs: list[int] = []
    run = session.run
    session.run = lambda out, feed, *a: (runs.append(1), run(out, feed, *a))[1]
    return runs


def test_a_one_core_lane_runs_a_hot_encoder_on_a_one_thread_twin_of_its_merged_session(two_threads, pool):
    b = two_threads
    keys = [("h1@1", "h2@1")[i % 2] for i in range(len(TEXTS))]
    merged = b.merged.encode(TEXTS, keys)                 # h1 on the merged session (both threads), h2 on torch
    single = served_single(b)
    assert single is not None
    single(TEXTS, keys)                                   # the first one-core batch starts the twin
    assert b.merged.twin_ready("h1@1", timeout=120)
    assert b.builds_started()["one-core merged session"] == 1 and "one-core merged session" not in b.building()
    twin = b.merged._twins["h1@1"].session
    assert twin.get_session_options().intra_op_num_threads == 1
    runs, main_runs = _spy_run(twin), _spy_run(b.merged._sessions["h1@1"].session)
    got, flags = single(TEXTS, keys)
    assert runs and not main_runs and flags == [False] * len(TEXTS)   # h1's rows on the twin alone
    h1 = [i for i, k in enumerate(keys) if k == "h1@1"]
    assert cosine(got[h1], merged[h1]).min() >= 0.99999
    ref = np.stack([pool.encode([t], [k])[0] for t, k in zip(TEXTS, keys)])
    assert cosine(got, ref).min() >= MIN_COSINE
    assert b.merged.memory_bytes("h1@1") == 2 * b.merged.memory_bytes("h2@1")   # the twin holds the weights again
    assert single(TEXTS, keys) is not None and b.builds_started()["one-core merged session"] == 1   # built once


def test_a_hot_encoders_batch_runs_beside_a_busy_lane_on_the_twin_and_an_idle_server_on_both_cores(two_threads):
    # Two forward lanes over the real backend: while the first lane's pass is held, a search of the hot
    # encoder is answered at once on the second lane, on the twin (one core); with the server idle
    # again, the same search runs on the merged session's two threads.
    b = two_threads
    single = served_single(b)
    single(TEXTS[:2], ["h1@1"] * 2)                       # builds the twin
    assert b.merged.twin_ready("h1@1", timeout=120)
    twin_rows = _spy_run(b.merged._twins["h1@1"].session)
    main_rows = _spy_run(b.merged._sessions["h1@1"].session)
    held, release = threading.Event(), threading.Event()
    encode = served(b)

    def first_lane(texts, keys, encodings=None):
        if texts[0] == "held":
            held.set()
            assert release.wait(30), "never released"
        return encode(texts, keys, encodings=encodings)

    def search(q, k, flt, with_text):
        return [["hit"] * k for _ in q]

    batcher = MicroBatcher(encode=first_lane, search=search, window_s=0.0, lanes=2, encode_single=single)
    batcher.start()
    try:
        async def main():
            first = asyncio.ensure_future(batcher.embed(["held"], "h2@1", ticket=Ticket()))
            assert await asyncio.to_thread(held.wait, 30)
            beside = await asyncio.wait_for(batcher.embed([TEXTS[0]], "h1@1", ticket=Ticket()), 30)
            assert not first.done()                       # still in its held pass
            ran_beside = (list(twin_rows), list(main_rows))
            release.set()
            await asyncio.wait_for(first, 30)
            idle = await asyncio.wait_for(batcher.embed([TEXTS[0]], "h1@1", ticket=Ticket()), 30)
            return beside, idle, ran_beside
        try:
            beside, idle, ran_beside = asyncio.run(main())
        finally:
            release.set()
    finally:
        batcher.stop()
    assert ran_beside == ([1], [])                        # beside the held pass: the twin
    assert twin_rows == [1] and main_rows == [1]          # idle: the merged session, both threads
    assert cosine(beside.vectors, idle.vectors).min() >= 0.99999


FOUR = [f"q{i}@1" for i in range(1, 5)]


@pytest.fixture(scope="module")
def pool4(tiny_base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hot-four")
    pool = EncoderPool(tiny_base, factor_dtype="float32")
    for i, key in enumerate(FOUR):
        name = key.split("@")[0]
        pool.add(load_encoder(make_lora(tiny_base, tmp / name, name, seed=10 + i, r=4,
                                        targets=("query", "value", "dense")), tiny_base.space))
    return pool


def _four_domains(pool4, tmp_path, hot: int, mix: str) -> SharedBackend:
    b = SharedBackend(pool4, tmp_path, threads=2, hot=hot, hot_window=4 * len(FOUR), mix=mix)
    for key in FOUR:
        b.prepare(key)
    assert b.wait(timeout=120), b.error(FOUR[0])
    return b


@pytest.mark.parametrize("mix", ["auto", "segments"])
def test_four_equal_domains_all_run_merged_and_mixed_batches_answer_as_torch(pool4, tmp_path, monkeypatch, mix):
    b = _four_domains(pool4, tmp_path, hot=4, mix=mix)
    try:
        served(b)(TEXTS[:8] * 2, FOUR * 4)                        # one window, each domain a quarter: all hot
        for key in FOUR:
            assert b.merged.wait(key, timeout=120), b.merged.error(key)
        assert b.hot() == FOUR and {b.runtime(k) for k in FOUR} == {"onnx-merged"}
        calls = _spy_merged(b, monkeypatch)
        keys = [FOUR[i % 4] for i in range(len(TEXTS))]
        got = served(b)(TEXTS, keys)                              # one batch mixing the four hot encoders
        assert calls == [keys]                                    # every row on the merged sessions
        ref = np.stack([pool4.encode([t], [k])[0] for t, k in zip(TEXTS, keys)])
        assert cosine(got, ref).min() >= MIN_COSINE
    finally:
        b.close()


@pytest.mark.parametrize("mix", ["auto", "segments", "groups"])
def test_a_slot_limit_leaves_the_rest_shared_and_a_batch_mixing_both_answers_as_torch(pool4, tmp_path,
                                                                                      monkeypatch, mix):
    b = _four_domains(pool4, tmp_path, hot=2, mix=mix)
    try:
        # 7 / 5 / 2 / 2 of 16 rows: the two busiest reach hot_share(2) = 25 %; the others do not
        served(b)(TEXTS[:8] * 2, [FOUR[0]] * 7 + [FOUR[1]] * 5 + [FOUR[2]] * 2 + [FOUR[3]] * 2)
        for key in FOUR[:2]:
            assert b.merged.wait(key, timeout=120), b.merged.error(key)
        assert b.hot() == FOUR[:2]
        assert [b.runtime(k) for k in FOUR] == ["onnx-merged"] * 2 + ["onnx-shared"] * 2
        calls = _spy_merged(b, monkeypatch)
        keys = [FOUR[i % 4] for i in range(len(TEXTS))]
        got = b.encode(TEXTS, keys)                               # not counted: the hot set stays
        assert calls == [[k for k in keys if k in FOUR[:2]]]      # the hot rows, and only they, ran merged
        ref = np.stack([pool4.encode([t], [k])[0] for t, k in zip(TEXTS, keys)])
        assert cosine(got, ref).min() >= MIN_COSINE
        # the traffic turns to the other two: the first two leave, the others take their slots
        served(b)(TEXTS[:8] * 2, [FOUR[2]] * 8 + [FOUR[3]] * 8)
        for key in FOUR[2:]:
            assert b.merged.wait(key, timeout=120), b.merged.error(key)
        assert b.hot() == FOUR[2:] and not any(b.merged.ready(k) for k in FOUR[:2])
    finally:
        b.close()

"""Mixed batches as ONE segment call (``SharedBackend(mix="segments")``): each LoRA encoder's
factors once per call, each row's tokens routed to its own; the same answers per row as the
per-group calls and as torch, for batches of 1, 4 and 20 encoders with mixed ranks, base rows and
bias rows (the bias kind runs in its own bound call beside the segment call)."""

from __future__ import annotations

import json
import threading
from typing import Callable

import numpy as np
import onnx as onnx_model
import pytest

from qswap.encoders import BASE_KEY, EncoderPool, load_encoder
from qswap.encoders.runtime import onnx, packed_export, shared_export, shared_segments
from qswap.encoders.runtime.packed_export import PACKED_INPUTS, PACKED_SEGMENTS_FILE
from qswap.encoders.runtime.shared import SharedBackend
from qswap.encoders.runtime.packing import segment_routing
from qswap.encoders.runtime.shared_segments import SegmentRunner
from qswap.errors import InvalidInputError

from .adapters import make_lora, make_overrides
from .test_shared import MIN_COSINE, TEXTS, _pool, _ready_backend, cosine, encoder_dirs, pool  # noqa: F401 (fixtures)

# LoRA r=4 and r=8 on different layers, bias, base, and a partial encoder (merged export), interleaved.
MIXED = ["l1@1", BASE_KEY, "l2@1", "b1@1", "p1@1", "l2@1", "l1@1", "b1@1", BASE_KEY]
# The 20-encoder pool's bias encoders, and a long row (~40 tokens) among the short TEXTS.
BIASED = ["bias0@1", "bias1@1"]
LONG = " ".join(["science"] * 30) + " for the linux search server"
# What each rank/target set of the 20-encoder pool adapts.
SHAPES = [(2, ("query", "value")), (4, ("key", "intermediate.dense")), (8, ("query", "key", "value", "dense")),
          (16, ("value", "output.dense"))]


@pytest.fixture(scope="module")
def segmented(pool, tmp_path_factory):
    b = _ready_backend(pool, tmp_path_factory.mktemp("segments"), mix="segments")
    yield b
    b.close()


class _Spy:
    """Counts the rows of each segment call and the per-group calls of a backend (the real ones run)."""

    def __init__(self, backend: SharedBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.segments: list[int] = []
        self.encoders: list[set[str]] = []
        self.packed: list[bool] = []   # per segment call: whether it ran the packed graph
        self.groups = 0
        run, call = SegmentRunner.run, backend._call

        def spy_run(runner, session, inputs, mask, keys):
            self.segments.append(len(keys))
            self.encoders.append(set(keys))
            self.packed.append("token_index" in inputs)
            return run(runner, session, inputs, mask, keys)

        def spy_call(*a):
            self.groups += 1
            return call(*a)
        monkeypatch.setattr(SegmentRunner, "run", spy_run)
        monkeypatch.setattr(backend, "_call", spy_call)


def _alone(pool, texts, keys) -> np.ndarray:
    """Torch, row by row: each row with its own encoder only."""
    return np.stack([pool.encode([t], [k])[0] for t, k in zip(texts, keys)])


def test_routing_sends_every_token_back_to_its_place():
    r = segment_routing(np.array([0, 1, 0, 2, 0]), 3, [2, 2, 2, 2, 2], packed=False)
    tokens, back = r["segment_tokens"], r["segment_positions"]
    assert tokens.shape == (3, 3 * 2)                        # three encoders, the largest has three rows
    assert back.shape == (5, 2)                               # (rows, tokens): the Gather gives (n, L, width)
    assert (tokens.reshape(-1)[back] == np.arange(10).reshape(5, 2)).all()  # each token's product comes back to it
    assert set(tokens[1]) == {2, 3} and set(tokens[0]) == {0, 1, 4, 5, 8, 9}


def test_packed_routing_routes_real_tokens_only():
    # rows of 3, 1, 2 and 4 real tokens end to end (10 tokens); encoders 1, 0, 1, 2
    r = segment_routing([1, 0, 1, 2], 3, [3, 1, 2, 4], packed=True)
    tokens, back = r["segment_tokens"], r["segment_positions"]
    assert tokens.shape == (3, 5)                             # encoder 1 has the most tokens: 3 + 2
    assert back.shape == (10,)                                # one per real token: the Gather gives (T, width)
    assert (tokens.reshape(-1)[back] == np.arange(10)).all()
    assert tokens[1].tolist() == [0, 1, 2, 4, 5] and set(tokens[0]) == {3} and set(tokens[2]) == {6, 7, 8, 9}
    # padded rows of the same batch route 4 x 4 slots, pads included
    assert segment_routing([1, 0, 1, 2], 3, [3, 1, 2, 4], packed=False)["segment_tokens"].shape == (3, 8)


def test_mixed_batch_is_one_segment_call_equal_to_groups_and_torch(segmented, pool, tmp_path, monkeypatch):
    assert not segmented.segments_ready()               # built only once a batch mixes encoders
    first = segmented.encode(TEXTS, MIXED)              # per group meanwhile
    assert segmented.segments_ready(wait=120)
    spy = _Spy(segmented, monkeypatch)
    got = segmented.encode(TEXTS, MIXED)
    lora_or_base = sum(k in ("l1@1", "l2@1", BASE_KEY) for k in MIXED)
    assert sum(spy.segments) == lora_or_base and len(spy.segments) <= 2   # one call, or two length buckets
    assert spy.groups >= 1                              # the bias encoder: its own bound call
    groups = _ready_backend(pool, tmp_path / "groups", mix="groups")
    try:
        per_group = groups.encode(TEXTS, MIXED)
    finally:
        groups.close()
    alone = _alone(pool, TEXTS, MIXED)
    assert cosine(got, per_group).min() >= MIN_COSINE
    assert cosine(got, alone).min() >= MIN_COSINE
    assert cosine(first, alone).min() >= MIN_COSINE
    # Each row carries its own encoder: the same text under three encoders differs.
    same = segmented.encode([TEXTS[0]] * 3, ["l1@1", "l2@1", BASE_KEY])
    assert cosine(same[:2], same[2:].repeat(2, 0)).max() < 0.999


@pytest.fixture(scope="module")
def twenty(tiny_base, tmp_path_factory):
    """20 LoRA encoders of four ranks and target sets and two bias encoders in one pool; a
    segment and a per-group backend over it."""
    tmp = tmp_path_factory.mktemp("twenty")
    pool = EncoderPool(tiny_base)
    keys = []
    for i in range(20):
        r, targets = SHAPES[i % len(SHAPES)]
        pool.add(load_encoder(make_lora(tiny_base, tmp / f"e{i}", f"e{i}", seed=10 + i, r=r, targets=targets),
                              tiny_base.space))
        keys.append(f"e{i}@1")
    for i in range(2):
        pool.add(load_encoder(make_overrides(tiny_base, tmp / f"bias{i}", f"bias{i}", "bias", seed=50 + i),
                              tiny_base.space))
    backends = {}
    for mix in ("segments", "groups"):
        b = SharedBackend(pool, tmp / mix, threads=1, mix=mix)
        for k in [*keys, *BIASED, BASE_KEY]:
            b.prepare(k)
        assert b.wait(keys[0], timeout=120), b.error(keys[0])
        backends[mix] = b
    yield pool, keys, backends
    for b in backends.values():
        b.close()


@pytest.mark.parametrize("k", [1, 4, 20])
@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_batches_of_1_4_and_20_encoders_equal_torch(twenty, k, order, monkeypatch):
    pool, keys, backends = twenty
    seg = backends["segments"]
    # Rows of 3 to ~40 tokens, uneven groups of LoRA encoders of four ranks, the base's row and
    # two bias encoders' rows (their own bound calls beside the segment call).
    texts = [LONG if i % 11 == 5 else TEXTS[i % len(TEXTS)] for i in range(27)]
    mix = [keys[(i * 7) % k] for i in range(23)] + [BASE_KEY, *BIASED, BIASED[0]]
    if order == "reversed":
        texts, mix = texts[::-1], mix[::-1]
    seg.encode(texts[:2], keys[:2])                              # builds the segment graph
    assert seg.segments_ready(wait=120)
    spy = _Spy(seg, monkeypatch)
    # On the CPU the segment graph runs packed, its calls cut as a one-encoder batch's are.
    rows = [i for i, key in enumerate(mix) if key not in BIASED]
    encs = seg.base.tokenizer.encode_batch([seg.base.spec.query_prefix + texts[i] for i in rows])
    buckets = sum(1 for _ in seg._buckets([texts[i] for i in rows], encs, packed=True))
    got = seg.encode(texts, mix)
    assert len(spy.segments) == buckets and all(spy.packed) and spy.groups >= len(BIASED)
    assert sum(spy.segments) == len(rows)                       # every row of a LoRA encoder or the base
    assert set().union(*spy.encoders) == set(mix) - set(BIASED)
    assert cosine(got, _alone(pool, texts, mix)).min() >= MIN_COSINE
    assert cosine(got, backends["groups"].encode(texts, mix)).min() >= MIN_COSINE


def test_the_cpu_segment_graph_is_packed_and_fused(twenty, tiny_base):
    seg = twenty[2]["segments"]
    seg.encode(TEXTS[:2], twenty[1][:2])
    assert seg.segments_ready(wait=120)
    target = seg.directory().with_name(seg.directory().name + "-packed-segments")
    names = [i.name for i in onnx_model.load(str(target / PACKED_SEGMENTS_FILE), load_external_data=False).graph.input]
    assert names[:len(PACKED_INPUTS) + 2] == [*PACKED_INPUTS, "segment_tokens", "segment_positions"]
    facts = json.loads((target / "export.json").read_text())
    layers = tiny_base.model.config.num_hidden_layers
    # the broadcast Add of a packed LoRA product leaves the optimiser's fusions as in the padded graph
    assert facts["fused"]["MultiHeadAttention"] == layers and facts["fused"]["BiasGelu"] == layers
    assert facts["fused"]["SkipLayerNormalization"] >= 2 * layers and facts["probe_min_cosine"] >= MIN_COSINE


def test_a_base_that_cannot_run_packed_runs_the_padded_segment_graph(pool, tmp_path, monkeypatch):
    # As on a GPU or for a base whose attention is not fused: padded rows, segments.onnx.
    monkeypatch.setattr("qswap.encoders.runtime.shared.packable", lambda layout: False)
    b = _ready_backend(pool, tmp_path, mix="segments")
    try:
        b.encode(TEXTS, MIXED)
        assert b.segments_ready(wait=120)
        spy = _Spy(b, monkeypatch)
        texts, keys = TEXTS + [LONG], MIXED + ["l2@1"]
        got = b.encode(texts, keys)
        assert spy.segments and not any(spy.packed)
        assert (b.directory().with_name(b.directory().name + "-segments") / shared_export.SEGMENTS_MODEL_FILE).exists()
        assert cosine(got, _alone(pool, texts, keys)).min() >= MIN_COSINE
    finally:
        b.close()


def test_one_encoder_keeps_its_bound_call(segmented, monkeypatch):
    assert segmented.segments_ready(wait=120)
    spy = _Spy(segmented, monkeypatch)
    segmented.encode(TEXTS, ["l2@1"] * len(TEXTS))
    assert spy.groups >= 1 and not spy.segments


def test_factors_stay_in_their_slots_until_discarded(tiny_base, encoder_dirs, tmp_path, monkeypatch):
    pool = _pool(tiny_base, encoder_dirs)   # its own pool: discard below must not touch the module's
    b = _ready_backend(pool, tmp_path, mix="segments")
    try:
        b.encode(TEXTS[:2], ["l1@1", BASE_KEY])          # starts the segment build
        assert b.segments_ready(wait=120)
        runner = b._segments[1]
        first = b.encode(TEXTS[:3], ["l1@1", BASE_KEY, "l2@1"])
        copies: list[str] = []
        fill = SegmentRunner._fill

        def spy_fill(self, name, shape, order, pick):
            held = self._held.get(name, ((), []))
            copies.extend(k for e, k in enumerate(order) if held[0] != shape or e >= len(held[1]) or held[1][e] != k)
            return fill(self, name, shape, order, pick)
        monkeypatch.setattr(SegmentRunner, "_fill", spy_fill)
        again = b.encode([TEXTS[2], TEXTS[0], TEXTS[1]], ["l2@1", "l1@1", BASE_KEY])   # other order: nothing copied
        assert not copies
        assert cosine(first[[2, 0, 1]], again).min() >= MIN_COSINE
        b.discard("l2@1")
        assert all("l2@1" not in keys for _, keys in runner._held.values()) and "l2@1" not in runner._sources
        assert runner.nbytes() > 0
    finally:
        b.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_factors_segments_equal_groups(tiny_base, encoder_dirs, tmp_path, dtype):
    hpool = _pool(tiny_base, encoder_dirs, dtype)
    g, p = _ready_backend(hpool, tmp_path / "g", mix="segments"), _ready_backend(hpool, tmp_path / "p", mix="groups")
    try:
        g.encode(TEXTS, MIXED)
        assert g.segments_ready(wait=120)
        assert cosine(g.encode(TEXTS, MIXED), p.encode(TEXTS, MIXED)).min() >= MIN_COSINE
    finally:
        g.close()
        p.close()


def test_more_encoders_than_a_call_holds_run_as_several_calls(segmented, pool, monkeypatch):
    assert segmented.segments_ready(wait=120)
    monkeypatch.setattr(shared_segments, "MAX_SEGMENTS", 2)
    spy = _Spy(segmented, monkeypatch)
    keys = ["l1@1", "l2@1", BASE_KEY, "l1@1"]
    got = segmented.encode(TEXTS[:4], keys)
    assert len(spy.segments) >= 2 and max(len(e) for e in spy.encoders) <= 2 and sum(spy.segments) == 4
    assert cosine(got, _alone(pool, TEXTS[:4], keys)).min() >= MIN_COSINE


def _patch_segment_exports(monkeypatch: pytest.MonkeyPatch, before: Callable[[], None]) -> None:
    """Call ``before`` ahead of every segment graph export, packed (the CPU's) or padded."""
    for module, name in ((shared_export, "export_shared"), (packed_export, "export_packed")):
        def wrapped(*a, segments=False, _real=getattr(module, name), **kw):
            if segments:
                before()
            return _real(*a, segments=segments, **kw)
        monkeypatch.setattr(module, name, wrapped)


def test_a_failed_segment_export_leaves_mixed_batches_per_group(pool, tmp_path, monkeypatch):
    def broken():
        raise OSError("disk full")
    _patch_segment_exports(monkeypatch, broken)
    b = _ready_backend(pool, tmp_path, mix="segments")
    try:
        first = b.encode(TEXTS, MIXED)
        assert not b.segments_ready(wait=120)
        ref = _alone(pool, TEXTS, MIXED)
        assert cosine(b.encode(TEXTS, MIXED), ref).min() >= MIN_COSINE
        assert cosine(first, ref).min() >= MIN_COSINE
    finally:
        b.close()


def test_unknown_mix_is_refused(pool, tmp_path):
    with pytest.raises(InvalidInputError, match="mix"):
        SharedBackend(pool, tmp_path, mix="gathered")


def test_auto_runs_segments_only_for_small_groups(pool, tmp_path, monkeypatch):
    from qswap.encoders.runtime.shared_run import SEGMENTS_BELOW_ROWS_PER_GROUP as below, segment_groups

    assert segment_groups(2 * below - 1, 2) and not segment_groups(2 * below, 2) and not segment_groups(8, 1)
    b = _ready_backend(pool, tmp_path, mix="auto")
    try:
        small = ["l1@1", "l2@1", BASE_KEY]                  # one row per encoder: one segment call
        b.encode(TEXTS[:3], small)
        assert b.segments_ready(wait=120)
        spy = _Spy(b, monkeypatch)
        got = b.encode(TEXTS[:3], small)
        assert sum(spy.segments) == 3 and spy.groups == 0
        spy.segments.clear()
        big = ["l1@1"] * below + ["l2@1"] * below           # groups of the threshold's size: per group
        b.encode([TEXTS[i % len(TEXTS)] for i in range(2 * below)], big)
        assert not spy.segments and spy.groups >= 2
        assert cosine(got, _alone(pool, TEXTS[:3], small)).min() >= MIN_COSINE
    finally:
        b.close()


def test_the_bulk_lane_never_runs_segments(segmented, pool, monkeypatch):
    segmented.encode(TEXTS, MIXED)   # a mixed batch starts the segment graph (if no test before did)
    assert segmented.segments_ready(wait=120)
    spy = _Spy(segmented, monkeypatch)
    got, _ = segmented.encode_flagged_bulk(TEXTS, MIXED)   # one core, per group, in this thread
    assert not spy.segments and spy.groups >= 4
    assert cosine(got, _alone(pool, TEXTS, MIXED)).min() >= MIN_COSINE


def test_a_one_core_lane_runs_a_mixed_batch_as_one_call_of_the_single_threaded_segment_session(segmented, pool,
                                                                                              monkeypatch):
    segmented.encode(TEXTS, MIXED)   # a mixed batch starts the segment graph (if no test before did)
    assert segmented.segments_ready(wait=120)
    first, _ = segmented.encode_flagged_single(TEXTS, MIXED)   # per group meanwhile: starts the one-core session
    assert segmented.segments_single_ready(wait=120)
    sess = segmented._segments_single
    assert sess.get_session_options().intra_op_num_threads == 1
    used = []
    run = SegmentRunner.run
    inside, release = threading.Event(), threading.Event()

    def spy_run(self, session, inputs, mask, keys):
        used.append((self, session, len(keys)))
        if threading.current_thread().name == "held":   # the first lane stays in its call until released
            inside.set()
            assert release.wait(60)
        return run(self, session, inputs, mask, keys)
    monkeypatch.setattr(SegmentRunner, "run", spy_run)
    # Two lanes on one core at once: the second gets a runner of its own and finishes while the first is held.
    held: dict[str, np.ndarray] = {}
    lane = threading.Thread(target=lambda: held.setdefault("got", segmented.encode_flagged_single(TEXTS, MIXED)[0]),
                            name="held")
    lane.start()
    try:
        assert inside.wait(60)
        got, _ = segmented.encode_flagged_single(TEXTS, MIXED)
    finally:
        release.set()
        lane.join(60)
    assert not lane.is_alive()
    lora_or_base = sum(k in ("l1@1", "l2@1", BASE_KEY) for k in MIXED)
    runners = {id(r) for r, _, _ in used}
    assert len(runners) == 2 and all(s is sess for _, s, _ in used)   # its session, two runners
    assert segmented._segments[1] not in {r for r, _, _ in used}      # never the two-thread session's runner
    assert sum(n for _, _, n in used) == 2 * lora_or_base
    alone = _alone(pool, TEXTS, MIXED)
    for emb in (first, got, held["got"]):
        assert cosine(emb, alone).min() >= MIN_COSINE
    assert "one-core segment session" in segmented.builds_started()
    # An encoder prepared again is copied again by every runner, the one-core ones included.
    single = [r for r, _, _ in used]
    assert any("l1@1" in keys for r in single for _, keys in r._held.values())
    segmented.prepare("l1@1")
    assert not any("l1@1" in keys for r in single for _, keys in r._held.values())


def test_building_lists_what_runs_in_the_background_until_it_is_done(pool, tmp_path, monkeypatch):
    # The segment graph (first mixed batch) and a pinned encoder's merged graph are built in the
    # background: held here until released, so each is seen in flight, then done.
    started = {"segment graph": threading.Event(), "merged graph": threading.Event()}
    release = threading.Event()
    real_merged = onnx.cached_export

    def held_segments():
        started["segment graph"].set()
        assert release.wait(60)

    def held_merged(*a, **kw):
        started["merged graph"].set()
        assert release.wait(60)
        return real_merged(*a, **kw)
    _patch_segment_exports(monkeypatch, held_segments)
    b = _ready_backend(pool, tmp_path, mix="segments")
    try:
        assert b.building() == []                       # ready, and no batch has mixed encoders yet
        at_ready = b.builds_started()
        assert at_ready.get("shared graph", 0) >= 1     # its export (or cached load)
        monkeypatch.setattr("qswap.encoders.runtime.onnx.cached_export", held_merged)
        b.encode(TEXTS, MIXED)                          # the first mixed batch starts the segment graph
        b.pin("l2@1")
        assert started["segment graph"].wait(60) and started["merged graph"].wait(60)
        assert b.building() == ["segment graph", "merged graph"]
        in_flight = b.builds_started()                  # counted when started, whether or not finished
        for kind in ("segment graph", "merged graph"):
            assert in_flight[kind] == at_ready.get(kind, 0) + 1, (kind, at_ready, in_flight)
        release.set()
        assert b.segments_ready(wait=120) and b.wait("l2@1", timeout=120)
        assert b.building() == []
        b.encode(TEXTS, MIXED)                          # everything it needs is built: nothing starts
        assert b.builds_started() == in_flight
    finally:
        release.set()
        b.close()

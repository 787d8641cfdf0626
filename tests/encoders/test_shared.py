"""The shared ONNX runtime (the default backend): one base session, each encoder's adapter bound
per run; same answers as the torch pool for every adapter kind, adapter bytes only per encoder,
torch fallback while the export is missing or failed."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from qswap.encoders import BASE_KEY, EncoderPool, load_encoder
from qswap.encoders.kinds.base import TENSOR_OBJECT_BYTES
from qswap.encoders.runtime import shared as shared_mod
from qswap.encoders.runtime import packed_export as packed_export_mod
from qswap.encoders.runtime.backend import BACKENDS, make_backend
from qswap.encoders.runtime.cancel import cancellable, run_options
from qswap.encoders.embedding import length_buckets, padded_splits
from qswap.encoders.runtime.shared import SharedBackend, adapter_inputs
from qswap.encoders.runtime.packed_export import PACKED_MODEL_FILE

from ..counting import CountingTokenizer
from .adapters import make_lora, make_overrides

TEXTS = ["chess puzzle game", "audio and music", "physics data", "the linux search server",
         "a tool for python", "math and science library with many games and music tools for debian",
         "video games", "network client", "a"]
MIN_COSINE = 0.99999
# key -> (kind, runtime that must serve it)
KINDS = {"l1@1": ("lora", "onnx-shared"), "l2@1": ("lora", "onnx-shared"), "b1@1": ("bias", "onnx-shared"),
         "p1@1": ("partial", "onnx-merged"), BASE_KEY: ("identity", "onnx-shared")}


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def encoder_dirs(tiny_base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("enc")
    # Two LoRA ranks and target sets: one graph serves both (the rank is a dynamic axis).
    return [make_lora(tiny_base, tmp / "l1", "l1", seed=1, r=4, targets=("query", "value", "dense")),
            make_lora(tiny_base, tmp / "l2", "l2", seed=2, r=8, targets=("key", "intermediate.dense")),
            make_overrides(tiny_base, tmp / "b1", "b1", "bias", seed=3),
            make_overrides(tiny_base, tmp / "p1", "p1", "partial", seed=4)]


def _pool(tiny_base, dirs, factor_dtype: str = "float32") -> EncoderPool:
    pool = EncoderPool(tiny_base, factor_dtype=factor_dtype)
    for p in dirs:
        pool.add(load_encoder(p, tiny_base.space))
    return pool


@pytest.fixture(scope="module")
def pool(tiny_base, encoder_dirs):
    return _pool(tiny_base, encoder_dirs)   # float32 factors: the reference


def _ready_backend(pool, cache, threads: int = 1, mix: str = "groups") -> SharedBackend:
    """A shared backend over ``pool`` with every encoder of ``KINDS`` prepared and ready."""
    b = SharedBackend(pool, cache, threads=threads, mix=mix)
    for key in KINDS:
        b.prepare(key)
    for key in KINDS:
        assert b.wait(key, timeout=120), b.error(key)
    return b


@pytest.fixture(scope="module")
def backend(pool, tmp_path_factory):
    b = _ready_backend(pool, tmp_path_factory.mktemp("shared-cache"), threads=1)
    yield b
    b.close()


@pytest.mark.parametrize("key", list(KINDS))
def test_matches_torch_on_every_adapter_kind(backend, pool, key):
    kind, runtime = KINDS[key]
    assert backend.runtime(key) == runtime, kind
    got = backend.encode(TEXTS, [key] * len(TEXTS))
    ref = pool.encode(TEXTS, [key] * len(TEXTS))
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert cosine(got, ref).min() >= MIN_COSINE, kind
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    if key != BASE_KEY:   # the run really carries the adapter
        assert cosine(got, backend.encode(TEXTS, [BASE_KEY] * len(TEXTS))).min() < 0.999, kind


def _bound_in_place(pool, key, backend) -> bool:
    """Every graph input of ``key`` is one of the pool's own tensors (no copy)."""
    feed = adapter_inputs(pool, key, backend.slots)
    pooled = {t.data_ptr() for t in pool.runtime_tensors(key).values()}
    return bool(feed) and all(t.data_ptr() in pooled for t in feed.values())


def test_one_session_and_adapter_bytes_only(backend, pool):
    # LoRA factors and a bias encoder's biases are bound in place (the pool's tensors: no tensor
    # data beyond the pool's, only the objects that bind them); the partial encoder has a merged session.
    binding = backend.memory_bytes(BASE_KEY)   # no input of its own: its binding only
    assert 0 < binding < backend.memory_bytes("l1@1")
    for key in ("l1@1", "l2@1", "b1@1"):
        assert pool.memory_bytes(key) > 0
        assert _bound_in_place(pool, key, backend)
    assert backend.memory_bytes("p1@1") == backend.shared_bytes() > 0
    assert list(backend.merged._sessions) == ["p1@1"]
    assert (backend.directory() / PACKED_MODEL_FILE).exists()


def test_feeds_share_the_base_values_and_count_their_own(backend, pool):
    # The base's inputs an encoder does not set are one set of OrtValues in every feed (made
    # once); its own are its own. What is counted beyond the pool's tensors is the binding every
    # encoder has plus one OrtValue per input of its own.
    shared = backend._base_values
    binding = backend.memory_bytes(BASE_KEY)
    for key in ("l1@1", "l2@1", "b1@1"):
        own = adapter_inputs(pool, key, backend.slots)
        feed = backend._inputs[key].feed
        assert set(feed) == set(shared) | set(own)
        assert all((feed[n] is shared[n]) == (n not in own) for n in feed), key
        assert backend.memory_bytes(key) == binding + len(own) * shared_mod.VALUE_BYTES, key


def test_mixed_batch_keeps_input_order(backend, pool):
    keys = ["l1@1", BASE_KEY, "p1@1", "l2@1", "b1@1", "l1@1", "p1@1", "b1@1", "l2@1"]
    got = backend.encode(TEXTS, keys)
    alone = np.stack([pool.encode([t], [k])[0] for t, k in zip(TEXTS, keys)])
    assert cosine(got, alone).min() >= MIN_COSINE


def test_adapter_inputs_refuse_weight_replacements(backend, pool):
    # A partial encoder replaces weight matrices: not expressible as adapter inputs.
    assert adapter_inputs(pool, "p1@1", backend.slots) is None
    lora = adapter_inputs(pool, "l1@1", backend.slots)
    assert lora is not None and {n.rsplit(".", 1)[1] for n in lora} == {"lora_A", "lora_B"}
    bias = adapter_inputs(pool, "b1@1", backend.slots)
    assert bias is not None and all(n.endswith(".bias") for n in bias)
    assert any("LayerNorm" in n for n in bias)   # the bias kind tunes LayerNorm biases too


def test_pinned_encoder_runs_merged_with_the_same_answers(pool, tmp_path):
    b = SharedBackend(pool, tmp_path, threads=1)
    try:
        b.prepare("l1@1")
        b.pin("l1@1")
        assert b.wait("l1@1", timeout=120), b.error("l1@1")
        assert b.runtime("l1@1") == "onnx-merged"
        assert b.memory_bytes("l1@1") == b.shared_bytes()
        got = b.encode(TEXTS, ["l1@1"] * len(TEXTS))
        assert cosine(got, pool.encode(TEXTS, ["l1@1"] * len(TEXTS))).min() >= MIN_COSINE
    finally:
        b.close()


def test_failed_export_falls_back_to_torch(pool, tmp_path, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("no exporter here")
    monkeypatch.setattr(packed_export_mod, "export_packed", broken)   # the CPU's query graph
    b = SharedBackend(pool, tmp_path, threads=1)
    try:
        b.prepare("l1@1")
        assert not b.wait("l1@1", timeout=60)
        assert b.runtime("l1@1") == "torch" and "no exporter here" in (b.error("l1@1") or "")
        got = b.encode(TEXTS, ["l1@1"] * len(TEXTS))
        np.testing.assert_allclose(got, pool.encode(TEXTS, ["l1@1"] * len(TEXTS)), atol=1e-6)
    finally:
        b.close()


def test_shared_is_the_default_backend(pool, tmp_path):
    from qswap.server.config import ServerSettings

    assert BACKENDS[0] == "shared" and ServerSettings().backend == "shared"
    b = make_backend(BACKENDS[0], pool, tmp_path, threads=1)
    try:
        assert isinstance(b, SharedBackend)
    finally:
        b.close()


def test_length_buckets_pad_each_batch_to_its_own_longest(tiny_base):
    texts = ["a", "a much longer query with many more words than the others " * 3, "b c", "d"]
    seen = {}
    for idx, ids, mask in length_buckets(tiny_base.tokenizer, texts, "", batch_size=2):
        assert ids.shape == mask.shape and ids.dtype == np.int64
        assert mask.sum(1).max() == ids.shape[1]   # no column of padding only
        seen.update({i: ids.shape[1] for i in idx})
    assert sorted(seen) == [0, 1, 2, 3]
    assert seen[0] < seen[1] and seen[3] < seen[1]   # short rows do not pay for the long one


def _cost(widths, splits, call):
    return sum((hi - lo) * widths[lo] + call for lo, hi in splits)


def test_padded_splits_are_the_cheapest_cuts():
    """Against every way to cut 9 sorted rows (2^8 of them): the programme finds the least
    tokens-plus-calls cost within the row bound, covering every row in order."""
    import itertools
    import random
    rng = random.Random(0)
    for _ in range(20):
        widths = sorted((rng.randint(1, 60) for _ in range(9)), reverse=True)
        call, most = rng.choice([0, 8, 48, 500]), rng.choice([2, 4, 9])
        got = padded_splits(widths, most, call)
        assert [lo for lo, _ in got] == [0] + [hi for _, hi in got[:-1]] and got[-1][1] == 9
        assert all(hi - lo <= most for lo, hi in got)
        best = min(_cost(widths, s, call) for cuts in itertools.product([0, 1], repeat=8)
                   for s in [list(zip([0] + [i + 1 for i in range(8) if cuts[i]],
                                      [i + 1 for i in range(8) if cuts[i]] + [9]))]
                   if all(hi - lo <= most for lo, hi in s))
        assert _cost(widths, got, call) == best
    assert padded_splits([5, 4, 3], 2) == [(0, 2), (2, 3)]          # no call cost: runs of max_rows
    assert padded_splits([40, 12, 12, 12], 64, 8) == [(0, 1), (1, 4)]  # the long row alone
    assert padded_splits([40, 12, 12, 12], 64, 100) == [(0, 4)]       # a call dearer than the padding


def test_truncation_flags_come_from_the_forward_tokenisation(backend, pool):
    long = "chess " * 5000
    vecs, flags = backend.encode_flagged([TEXTS[0], long], ["l1@1", "l1@1"])
    assert flags == [False, True]
    assert cosine(vecs, pool.encode([TEXTS[0], long], ["l1@1", "l1@1"])).min() >= MIN_COSINE


def test_given_encodings_are_encoded_without_tokenising_again(backend, pool, monkeypatch):
    """A server tokenises a query once and hands the encodings on: the shared session, a merged
    export (the partial encoder) and the torch pool encode them without tokenising again."""
    keys = list(KINDS)
    texts = TEXTS[:len(keys)]
    expected = pool.encode(texts, keys)
    encs = pool.base.tokenizer.encode_batch([pool.base.spec.query_prefix + t for t in texts])
    counting = CountingTokenizer(pool.base.tokenizer)
    monkeypatch.setattr(pool.base, "tokenizer", counting)   # the backend reads the same base
    got, flags = backend.encode_flagged(texts, keys, encs)
    by_torch = pool.encode(texts, keys, encodings=encs)
    assert counting.texts == []
    assert flags == [False] * len(texts)
    assert cosine(got, expected).min() >= MIN_COSINE and cosine(by_torch, expected).min() >= MIN_COSINE



def test_requests_tokenised_apart_share_one_forward_pass(backend, pool):
    """The server's tokens stage tokenises each request on its own, so rows of one batch are not
    padded to one another: the batch is still one forward pass (not one per request after a
    failed batch), with each row's own answer."""
    import asyncio

    from qswap.server.serving.admission import Ticket
    from qswap.server.serving.batching import MicroBatcher

    passes: list[int] = []

    def encode(texts, keys, encodings=None):
        passes.append(len(texts))
        return backend.encode(texts, keys, encodings=encodings)

    prefix = pool.base.spec.query_prefix
    b = MicroBatcher(encode=encode, search=lambda *a: [], window_s=0.5, adaptive=False,
                     tokenize=lambda texts: pool.base.tokenizer.encode_batch([prefix + t for t in texts]))
    b.start()
    try:
        async def main():
            return await asyncio.gather(*[b.embed([t], "l1@1", ticket=Ticket()) for t in TEXTS])
        outs = asyncio.run(main())
    finally:
        b.stop()
    assert passes == [len(TEXTS)]
    got = np.concatenate([o.vectors for o in outs])
    assert cosine(got, pool.encode(TEXTS, ["l1@1"] * len(TEXTS))).min() >= MIN_COSINE


@pytest.fixture(scope="module")
def two_workers(pool, tmp_path_factory):
    """A backend that runs a mixed batch's encoder groups side by side (two workers)."""
    b = _ready_backend(pool, tmp_path_factory.mktemp("shared-groups"), threads=2)
    yield b
    b.close()


def test_mixed_groups_side_by_side_match_torch_per_row(two_workers, pool, monkeypatch):
    # Three adapter kinds and ranks (LoRA r=4, LoRA r=8 on other layers, bias) plus identity on
    # the shared graph, and a partial encoder on its merged export, interleaved.
    keys = ["l1@1", BASE_KEY, "l2@1", "b1@1", "p1@1", "l2@1", "l1@1", "b1@1", BASE_KEY]
    assert not two_workers.groups_side_by_side()       # built only once a batch mixes encoders
    first = two_workers.encode(TEXTS, keys)            # runs the groups in turn meanwhile
    assert two_workers.groups_side_by_side(wait=120)
    used: list[object] = []
    call = two_workers._call
    monkeypatch.setattr(two_workers, "_call", lambda s, *a: (used.append(s), call(s, *a))[1])
    got = two_workers.encode(TEXTS, keys)
    assert used and all(s is two_workers._group_session for s in used)   # really side by side
    assert len(used) >= 4                                                   # one call per group at least
    alone = np.stack([pool.encode([t], [k])[0] for t, k in zip(TEXTS, keys)])
    assert cosine(got, alone).min() >= MIN_COSINE
    assert cosine(first, alone).min() >= MIN_COSINE
    # Each row carries its own encoder: the same text under two encoders differs.
    same = two_workers.encode([TEXTS[0]] * 4, ["l1@1", "l2@1", "b1@1", BASE_KEY])
    assert cosine(same[:3], same[3:].repeat(3, 0)).max() < 0.999


def test_one_encoder_stays_one_call_on_the_multithreaded_session(two_workers, monkeypatch):
    used: list[object] = []
    call = two_workers._call
    monkeypatch.setattr(two_workers, "_call", lambda s, *a: (used.append(s), call(s, *a))[1])
    two_workers.encode(TEXTS, ["l1@1"] * len(TEXTS))
    # Its rows may be cut into calls by length (padded_splits); none leaves that session.
    assert used and set(used) == {two_workers._session}


def test_bulk_encode_runs_in_the_calling_thread_on_the_single_threaded_session(two_workers, pool, monkeypatch):
    # A server's bulk lane: every call on the single-threaded session, none on the group workers
    # or the interactive session; the same vectors as the interactive path.
    keys = ["l1@1", BASE_KEY, "b1@1", "l1@1"]
    texts = TEXTS[:4]
    two_workers.encode_flagged_bulk(texts, keys)      # builds the single-threaded session if none yet
    assert two_workers.groups_side_by_side(wait=120)
    used: list[tuple[object, str]] = []
    call = two_workers._call
    monkeypatch.setattr(two_workers, "_call",
                        lambda s, *a: (used.append((s, threading.current_thread().name)), call(s, *a))[1])
    vecs, flags = two_workers.encode_flagged_bulk(texts, keys)
    assert used and {u for u, _ in used} == {two_workers._group_session}
    assert {name for _, name in used} == {threading.current_thread().name}
    alone = np.stack([pool.encode([t], [k])[0] for t, k in zip(texts, keys)])
    assert cosine(vecs, alone).min() >= MIN_COSINE and flags == [False] * 4


def test_a_stopped_bulk_pass_raises_and_the_session_serves_on(two_workers, pool):
    # The bulk lane stops a pass whose client left (RunOptions.terminate): the ONNX Runtime call
    # raises instead of finishing; calls outside the block, and the next block, run as before.
    keys, texts = ["l1@1", BASE_KEY], TEXTS[:2]
    with cancellable() as cancel:
        assert two_workers.encode_flagged_bulk(texts, keys)[0].shape == (2, pool.base.dim)
        cancel.stop()
        with pytest.raises(Exception, match="terminate"):
            two_workers.encode_flagged_bulk(texts, keys)
    assert run_options() is None
    vecs, _ = two_workers.encode_flagged_bulk(texts, keys)
    with cancellable():
        again, _ = two_workers.encode_flagged_bulk(texts, keys)
    assert cosine(vecs, again).min() >= MIN_COSINE


def test_bound_inputs_survive_batch_sizes_and_concurrent_runs(two_workers, pool):
    from concurrent.futures import ThreadPoolExecutor

    ref = pool.encode(TEXTS, ["l2@1"] * len(TEXTS))
    # A binding keeps its output's shape unless rebound: a 9-row run, then 1-row runs.
    assert cosine(two_workers.encode(TEXTS, ["l2@1"] * len(TEXTS)), ref).min() >= MIN_COSINE
    with ThreadPoolExecutor(4) as ex:   # four runs of one encoder at once: one binding each
        outs = list(ex.map(lambda i: two_workers.encode([TEXTS[i]], ["l2@1"])[0], range(len(TEXTS))))
    assert cosine(np.stack(outs), ref).min() >= MIN_COSINE


def test_spread_groups_only_when_work_is_balanced():
    from qswap.encoders.runtime.shared_run import spread_groups

    assert spread_groups([16, 16, 16], groups=3, workers=2)
    assert not spread_groups([16, 16, 16], groups=3, workers=1)     # one worker: in turn
    assert not spread_groups([480, 16], groups=2, workers=2)        # one group dominates
    assert not spread_groups([64, 64], groups=1, workers=2)         # one encoder: its own calls


def test_a_failed_export_is_retried_and_then_serves_on_onnx(pool, tmp_path, monkeypatch):
    """An export that fails (here: out of file descriptors) is tried again later: once the
    cause is gone, encoders move from torch to the shared session without a restart."""
    import errno

    real = packed_export_mod.export_packed
    failing = threading.Event()
    failing.set()
    attempts: list[bool] = []

    def flaky(*a, **kw):
        attempts.append(failing.is_set())
        if failing.is_set():
            failing.clear()   # the cause goes away after the first attempt (fds freed)
            raise OSError(errno.EMFILE, "Too many open files")
        return real(*a, **kw)
    monkeypatch.setattr(packed_export_mod, "export_packed", flaky)
    b = SharedBackend(pool, tmp_path, threads=1, retry_s=0.01)
    try:
        b.prepare("l1@1")
        assert b.wait("l1@1", timeout=300), b.error("l1@1")   # waits through the retry
        assert attempts == [True, False]
        assert b.runtime("l1@1") == "onnx-shared" and b.error("l1@1") is None
        got = b.encode(TEXTS, ["l1@1"] * len(TEXTS))
        assert cosine(got, pool.encode(TEXTS, ["l1@1"] * len(TEXTS))).min() >= MIN_COSINE
    finally:
        b.close()


def test_the_shared_graph_is_fused(backend, tiny_base):
    # Attention is one MultiHeadAttention node per layer fed with the adapted projections, the
    # residual Adds + LayerNorms are SkipLayerNormalization with the dense biases folded in, and
    # the GELU takes its bias: what ONNX Runtime runs for a merged encoder.
    import json

    import onnx

    layers = tiny_base.model.config.num_hidden_layers
    fused = json.loads((backend.directory() / "export.json").read_text())["fused"]
    assert fused["MultiHeadAttention"] == layers and fused["BiasGelu"] == layers
    # one per residual, and the embeddings' sum + LayerNorm (position embeddings added token by token)
    assert fused["SkipLayerNormalization"] == 2 * layers + 1
    graph = onnx.load(str(backend.directory() / PACKED_MODEL_FILE)).graph
    ops = [n.op_type for n in graph.node]
    assert "Softmax" not in ops and "Erf" not in ops
    skip = [n for n in graph.node if n.op_type == "SkipLayerNormalization"]
    assert sum(len(n.input) == 5 and n.input[4].endswith(".bias") for n in skip) == 2 * layers   # biases folded


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def half(request, tiny_base, encoder_dirs, tmp_path_factory):
    """A pool holding LoRA factors in half precision and its shared backend."""
    pool = _pool(tiny_base, encoder_dirs, request.param)
    b = _ready_backend(pool, tmp_path_factory.mktemp(f"shared-{request.param}"), threads=1)
    yield request.param, pool, b
    b.close()


@pytest.mark.parametrize("key", ["l1@1", "l2@1", "b1@1", BASE_KEY])
def test_half_precision_factors_match_the_float32_reference(half, pool, key):
    dtype, hpool, b = half
    assert b.runtime(key) == "onnx-shared"
    ref = pool.encode(TEXTS, [key] * len(TEXTS))   # float32 factors, torch
    assert cosine(b.encode(TEXTS, [key] * len(TEXTS)), ref).min() >= MIN_COSINE
    assert cosine(hpool.encode(TEXTS, [key] * len(TEXTS)), ref).min() >= MIN_COSINE   # the torch path too


def test_half_precision_factors_halve_the_memory(half, pool):
    import torch

    dtype, hpool, b = half
    for key in ("l1@1", "l2@1"):
        tensors = hpool.runtime_tensors(key)
        assert {t.dtype for t in tensors.values()} == {getattr(torch, dtype)}
        assert hpool.attached(key).info["factors"] == dtype
        # half the bytes, up to the page the packed block is rounded to (qswap.encoders.factor_blocks)
        objects = TENSOR_OBJECT_BYTES * len(tensors)   # the same in both pools
        full, halved = pool.memory_bytes(key) - objects, hpool.memory_bytes(key) - objects
        assert 0 < full // 2 <= halved <= full // 2 + 4096
        assert b.memory_bytes(key) == b.memory_bytes(BASE_KEY) + len(tensors) * shared_mod.VALUE_BYTES
        assert _bound_in_place(hpool, key, b)
    assert hpool.memory_bytes("b1@1") == pool.memory_bytes("b1@1")   # biases stay float32


def test_factors_beyond_half_range_keep_float32(tiny_base, pool, tmp_path):
    # A factor of 1e6 overflows float16 (max 65504): that encoder keeps float32 factors and runs
    # on its merged export, with the same answers; nothing is silently rounded to inf.
    from safetensors.torch import load_file, save_file

    from qswap.encoders import save_encoder

    peft = make_lora(tiny_base, tmp_path / "big0", "big", seed=5, r=4)   # its files are peft's
    (peft / "manifest.json").unlink()
    state = load_file(str(peft / "adapter_model.safetensors"))
    save_file({k: v * (1e6 if "lora_A" in k else 1e-6) for k, v in state.items()}, str(peft / "adapter_model.safetensors"))
    path = tmp_path / "big"
    save_encoder(path, name="big", version="1", kind="lora", space=tiny_base.space, lora_dir=peft)
    hpool = EncoderPool(tiny_base, factor_dtype="float16")
    hpool.add(load_encoder(path, tiny_base.space))
    ref = EncoderPool(tiny_base)
    ref.add(load_encoder(path, tiny_base.space))
    assert hpool.attached("big@1").info["factors"] == "float32"
    assert hpool.memory_bytes("big@1") == ref.memory_bytes("big@1")
    b = SharedBackend(hpool, tmp_path / "cache", threads=1)
    try:
        b.prepare("big@1")
        assert b.wait("big@1", timeout=120), b.error("big@1")
        assert b.runtime("big@1") == "onnx-merged"
        got = b.encode(TEXTS, ["big@1"] * len(TEXTS))
        assert cosine(got, ref.encode(TEXTS, ["big@1"] * len(TEXTS))).min() >= MIN_COSINE
    finally:
        b.close()


def test_unknown_factor_dtype_is_refused(tiny_base):
    from qswap.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="float8"):
        EncoderPool(tiny_base, factor_dtype="float8")

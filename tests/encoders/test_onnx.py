"""ONNX Runtime backend: same answers as the torch pool on every adapter kind, no word
embeddings in the graphs, cached exports keyed by content, torch fallback until ready."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from qswap.encoders import BASE_KEY, EncoderPool, load_base, load_encoder, save_encoder
from qswap.encoders.runtime import packed_export
from qswap.encoders.runtime.export_cache import META_FILE
from qswap.encoders.runtime.onnx import OnnxBackend
from qswap.encoders.runtime.export_digest import EMBEDDINGS_FILE, MODEL_FILE
from qswap.errors import InvalidInputError, NotFoundError

from .adapters import make_lora, make_overrides, noisy

TEXTS = ["chess puzzle game", "audio and music", "physics data", "the linux search server",
         "a tool for python", "math and science library with many games and music tools for debian",
         "video games", "network client", "a"]
MIN_COSINE = 0.99999
KINDS = {"l1@1": "lora", "b1@1": "bias", "p1@1": "partial", BASE_KEY: "identity"}


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def pool(tiny_base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("enc")
    pool = EncoderPool(tiny_base)
    for p in (make_lora(tiny_base, tmp / "l1", "l1", seed=1, targets=("query", "value", "dense")),
              make_overrides(tiny_base, tmp / "b1", "b1", "bias", seed=3),
              make_overrides(tiny_base, tmp / "p1", "p1", "partial", seed=4)):
        pool.add(load_encoder(p, tiny_base.space))
    return pool


@pytest.fixture(scope="module")
def backend(pool, tmp_path_factory):
    b = OnnxBackend(pool, tmp_path_factory.mktemp("onnx-cache"), threads=1)
    for key in KINDS:
        b.prepare(key)
    for key in KINDS:
        assert b.wait(key, timeout=120), b.error(key)
    yield b
    b.close()


@pytest.mark.parametrize("key", list(KINDS))
def test_matches_torch_on_every_adapter_kind(backend, pool, key):
    got = backend.encode(TEXTS, [key] * len(TEXTS))
    ref = pool.encode(TEXTS, [key] * len(TEXTS))
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert cosine(got, ref).min() >= MIN_COSINE, KINDS[key]
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)   # normalised like torch
    if key != BASE_KEY:   # the graph really carries the adapter (not the base again)
        base = backend.encode(TEXTS, [BASE_KEY] * len(TEXTS))
        assert cosine(got, base).min() < 0.999, KINDS[key]


def test_sessions_stop_spinning_after_each_forward(backend):
    # Spinning pools of idle sessions would steal the cores of the one that runs next.
    opts = backend._sessions[BASE_KEY].session.get_session_options()
    assert opts.get_session_config_entry("session.force_spinning_stop") == "1"
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "1"


def test_mixed_keys_keep_input_order_and_fall_back(backend, pool, tiny_base, tmp_path):
    # "late" is in the pool but never prepared: its rows must go through torch.
    pool.add(load_encoder(make_overrides(tiny_base, tmp_path / "late", "late", "bias", seed=9),
                          tiny_base.space))
    try:
        keys = ["late@1", "l1@1", BASE_KEY, "p1@1", "late@1", "b1@1", "l1@1", "p1@1", BASE_KEY]
        assert not backend.ready("late@1")
        got = backend.encode(TEXTS, keys)
        alone = np.stack([pool.encode([t], [k])[0] for t, k in zip(TEXTS, keys)])
        assert cosine(got, alone).min() >= MIN_COSINE
        # the fallback rows are the torch rows exactly
        np.testing.assert_allclose(got[[0, 4]], alone[[0, 4]], atol=1e-6)
    finally:
        pool.remove("late@1")


def test_batches_longer_than_batch_size_and_ragged_lengths(pool, backend, tmp_path):
    small = OnnxBackend(pool, backend.cache_dir, threads=1, batch_size=3)
    try:
        small.prepare("p1@1")
        assert small.wait("p1@1", 60), small.error("p1@1")
        texts = TEXTS * 3
        got = small.encode(texts, ["p1@1"] * len(texts))
        ref = pool.encode(texts, ["p1@1"] * len(texts))
        assert cosine(got, ref).min() >= MIN_COSINE
    finally:
        small.close()


def test_a_batch_of_ragged_lengths_is_cut_where_padding_costs_more_than_a_call(backend, pool, monkeypatch):
    # 8 one-word queries and one of ~40 tokens: padding all nine to the long one would compute
    # ~4x their real tokens, so the long row runs in a call of its own; answers unchanged.
    texts = ["a"] * 8 + [" ".join(["science"] * 36)]
    widths: list[tuple[int, int]] = []
    session = backend._sessions["l1@1"].session
    run = session.run
    monkeypatch.setattr(session, "run", lambda out, feed: (widths.append(feed["attention_mask"].shape), run(out, feed))[1])
    got = backend.encode(texts, ["l1@1"] * len(texts))
    assert sorted(widths) == sorted([(1, max(w for _, w in widths)), (8, min(w for _, w in widths))])
    assert cosine(got, pool.encode(texts, ["l1@1"] * len(texts))).min() >= MIN_COSINE


def test_graph_holds_no_word_embedding_matrix(backend, tiny_base):
    import onnx

    vocab, dim = tiny_base.model.get_input_embeddings().weight.shape
    for key in KINDS:
        model = onnx.load(str(backend.directory(key) / MODEL_FILE))
        shapes = [tuple(t.dims) for t in model.graph.initializer]
        shapes += [tuple(a.t.dims) for n in model.graph.node for a in n.attribute if a.type == a.TENSOR]
        assert shapes, "the checker must see the graph's tensors"
        assert (dim, dim) in shapes or (dim, 3 * dim) in shapes   # it does see weight matrices
        assert not any(int(np.prod(s)) >= vocab * dim for s in shapes), (key, sorted(shapes)[-3:])
        assert not (backend.directory(key) / EMBEDDINGS_FILE).exists()


def test_cache_is_reused_and_keyed_by_content(pool, backend, tiny_base, tmp_path):
    d = backend.directory("b1@1")
    assert d.parent.name == "b1@1" and d.name == tiny_base.space.fingerprint + "-packed"   # the CPU's graph
    stamp = (d / MODEL_FILE).stat().st_mtime_ns
    again = OnnxBackend(pool, backend.cache_dir, threads=1)
    try:
        again.prepare("b1@1")
        assert again.wait("b1@1", 60)
        assert (d / MODEL_FILE).stat().st_mtime_ns == stamp   # loaded, not re-exported
    finally:
        again.close()
    # Same key, other weights (another pool): the digest differs, so it is exported again.
    other = EncoderPool(tiny_base)
    other.add(load_encoder(make_overrides(tiny_base, tmp_path / "b1", "b1", "bias", seed=77), tiny_base.space))
    fresh = OnnxBackend(other, backend.cache_dir, threads=1)
    try:
        fresh.prepare("b1@1")
        assert fresh.wait("b1@1", 60)
        got = fresh.encode(TEXTS, ["b1@1"] * len(TEXTS))
        assert cosine(got, other.encode(TEXTS, ["b1@1"] * len(TEXTS))).min() >= MIN_COSINE
        assert cosine(got, pool.encode(TEXTS, ["b1@1"] * len(TEXTS))).min() < 0.999
    finally:
        fresh.close()


def test_adapter_owning_word_embeddings_gets_its_own_table(tiny_base, tmp_path):
    name = "embeddings.word_embeddings.weight"
    w = tiny_base.model.get_input_embeddings().weight
    save_encoder(tmp_path / "we", name="we", version="1", kind="partial", space=tiny_base.space,
                 tensors=noisy({name: w}, 0.5, 5))
    pool = EncoderPool(tiny_base)
    pool.add(load_encoder(tmp_path / "we", tiny_base.space))
    b = OnnxBackend(pool, tmp_path / "cache", threads=1)
    try:
        b.prepare("we@1")
        assert b.wait("we@1", 60), b.error("we@1")
        assert (b.directory("we@1") / EMBEDDINGS_FILE).exists()
        got = b.encode(TEXTS, ["we@1"] * len(TEXTS))
        ref = pool.encode(TEXTS, ["we@1"] * len(TEXTS))
        assert cosine(got, ref).min() >= MIN_COSINE
        assert cosine(got, pool.encode(TEXTS, [BASE_KEY] * len(TEXTS))).min() < 0.999
    finally:
        b.close()


def test_failed_export_stays_on_torch(pool, tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("exporter exploded")

    monkeypatch.setattr(packed_export, "export_packed", broken)   # what the backend calls to export on CPU
    b = OnnxBackend(pool, tmp_path / "cache", threads=1)
    try:
        b.prepare("l1@1")
        assert b.wait("l1@1", 30) is False
        assert "exporter exploded" in (b.error("l1@1") or "")
        np.testing.assert_allclose(b.encode(TEXTS, ["l1@1"] * len(TEXTS)),
                                   pool.encode(TEXTS, ["l1@1"] * len(TEXTS)), atol=1e-6)
        assert not (b.directory("l1@1") / META_FILE).exists()
    finally:
        b.close()


def test_discard_and_bad_input(backend, pool, tmp_path):
    b = OnnxBackend(pool, backend.cache_dir, threads=1)
    try:
        b.prepare("b1@1")
        b.prepare("b1@1")   # idempotent
        assert b.wait("b1@1", 60)
        b.discard("b1@1")
        assert not b.ready("b1@1")
        np.testing.assert_allclose(b.encode(TEXTS[:2], ["b1@1"] * 2), pool.encode(TEXTS[:2], ["b1@1"] * 2),
                                   atol=1e-6)
        with pytest.raises(NotFoundError):
            b.prepare("nope@1")
        with pytest.raises(NotFoundError):
            b.encode(["x"], ["nope@1"])
        with pytest.raises(InvalidInputError):
            b.encode(["x", "y"], [BASE_KEY])
        assert b.encode([], []).shape == (0, pool.base.dim)
    finally:
        b.close()


def test_concurrent_encodes_while_exporting(pool, tmp_path):
    b = OnnxBackend(pool, tmp_path / "cache", threads=1)
    ref = {k: pool.encode(TEXTS, [k] * len(TEXTS)) for k in KINDS}
    errors: list[str] = []

    def worker(key: str) -> None:
        for _ in range(15):
            got = b.encode(TEXTS, [key] * len(TEXTS))
            if cosine(got, ref[key]).min() < MIN_COSINE:
                errors.append(key)

    try:
        for k in KINDS:
            b.prepare(k)
        threads = [threading.Thread(target=worker, args=(k,)) for k in KINDS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(b.wait(k, 60) for k in KINDS)
        assert not errors
    finally:
        b.close()


@pytest.mark.slow
def test_minilm_ort_equals_torch(tmp_path):
    """all-MiniLM-L6-v2: identity and a bias encoder agree with torch to cosine >= 0.99999."""
    base = load_base("all-minilm-l6-v2", device="cpu")
    pool = EncoderPool(base)
    pool.add(load_encoder(make_overrides(base, tmp_path / "b", "b", "bias", seed=1), base.space))
    b = OnnxBackend(pool, tmp_path / "cache")
    try:
        texts = ["how much protein per day", "a free chess engine for the terminal",
                 "Debian package that converts audio files between formats, with a graphical interface "
                 "and command line tools for batch processing", "x", "Wörterbuch für Linux"] * 3
        for key in (BASE_KEY, "b@1"):
            b.prepare(key)
            assert b.wait(key, 300), b.error(key)
            got = b.encode(texts, [key] * len(texts))
            ref = pool.encode(texts, [key] * len(texts))
            assert cosine(got, ref).min() >= MIN_COSINE, key
        import onnx
        vocab, dim = base.model.get_input_embeddings().weight.shape
        model = onnx.load(str(b.directory(BASE_KEY) / MODEL_FILE))
        assert max(int(np.prod(t.dims)) for t in model.graph.initializer) < vocab * dim
        rest = sum(p.numel() for p in base.model.parameters()) * 4 - vocab * dim * 4
        assert (b.directory(BASE_KEY) / MODEL_FILE).stat().st_size < 1.05 * rest   # the graph is the rest
    finally:
        b.close()


def _other_arch(path, arch: str):
    """A tiny model of another supported architecture, with the tiny BERT's tokenizer."""
    import json

    from transformers import DistilBertConfig, DistilBertModel, XLMRobertaConfig, XLMRobertaModel

    from ..conftest import make_tiny_model

    make_tiny_model(path, name=f"tiny-{arch}")
    for f in ("config.json", "model.safetensors"):
        (path / f).unlink()
    vocab = len(json.loads((path / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(3)
    if arch == "xlm-roberta":   # positions count from the padding index: computed in the graph
        cfg = XLMRobertaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=70, pad_token_id=0)
        XLMRobertaModel(cfg, add_pooling_layer=False).save_pretrained(str(path))
    else:
        cfg = DistilBertConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                               max_position_embeddings=64, pad_token_id=0)
        DistilBertModel(cfg).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("arch", ["xlm-roberta", "distilbert"])
def test_other_architectures_match_torch(arch, tmp_path):
    base = load_base(_other_arch(tmp_path / arch, arch), device="cpu")
    pool = EncoderPool(base)
    b = OnnxBackend(pool, tmp_path / "cache", threads=1)
    try:
        b.prepare(BASE_KEY)
        assert b.wait(BASE_KEY, 120), b.error(BASE_KEY)
        got = b.encode(TEXTS, [BASE_KEY] * len(TEXTS))
        assert cosine(got, pool.encode(TEXTS, [BASE_KEY] * len(TEXTS))).min() >= MIN_COSINE
    finally:
        b.close()

"""The packed (padding-free) query graphs: a batch's real tokens as one row, padded only inside
attention. Same answers as per-row torch for mixed lengths and mixed encoders, on the shared
runtime and on merged exports; a row's vector does not depend on the rows beside it."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from qswap.encoders import BASE_KEY
from qswap.encoders.embedding import padded_splits
from qswap.encoders.runtime.export_digest import MODEL_FILE
from qswap.encoders.runtime.onnx import OnnxBackend
from qswap.encoders.runtime.packed_export import PACKED_INPUTS, PACKED_MODEL_FILE
from qswap.encoders.runtime.packing import packing

from .test_shared import MIN_COSINE, _ready_backend, cosine, encoder_dirs, pool  # noqa: F401 (fixtures)

# Lengths from 1 word to ~40 tokens, in no order: every batch below mixes them.
TEXTS = ["a", "chess puzzle game with levels", "audio", "the linux search server for python and debian packages",
         "physics", " ".join(["science"] * 30), "a tool for python", "network client library", "video games"]
KEYS = ["l1@1", "b1@1", "l2@1", BASE_KEY]   # the encoders of test_shared that run on the shared graph


def _torch_rows(pool, texts: list[str], keys: list[str]) -> np.ndarray:
    """The torch reference, each row alone (no padding anywhere)."""
    return np.concatenate([pool.encode([t], [k]) for t, k in zip(texts, keys)])


def test_packing_routes_every_token_once():
    f = packing([3, 1, 2], "mean", first_position=2)
    assert f["position_ids"].tolist() == [[2, 3, 4, 2, 2, 3]]
    assert f["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    # padded slot -> packed token; pad slots read their row's first token (masked, never read back)
    assert f["token_index"].tolist() == [[0, 1, 2], [3, 3, 3], [4, 5, 4]]
    assert f["token_positions"].tolist() == [0, 1, 2, 3, 6, 7]
    np.testing.assert_allclose(f["pooling"].sum(1), 1.0)
    assert f["pooling"][1].tolist() == [0, 0, 0, 1, 0, 0]
    assert packing([3, 1, 2], "cls")["pooling"].tolist() == [[1, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0],
                                                             [0, 0, 0, 0, 1, 0]]


def test_packed_cuts_only_where_attention_padding_costs_more_than_a_call():
    short = [20] * 15
    assert padded_splits([30] + short, 64, 16, attention_dim=384) == [(0, 16)]   # one call
    # a 512-token row among short ones: its attention, padded to every row, outweighs a call
    assert padded_splits([512] + short, 64, 16, attention_dim=384) == [(0, 1), (1, 16)]


@pytest.fixture(scope="module")
def shared(pool, tmp_path_factory):
    b = _ready_backend(pool, tmp_path_factory.mktemp("packed-shared"))
    yield b
    b.close()


def test_the_shared_runtime_runs_the_packed_graph(shared, tiny_base):
    path = shared.directory() / PACKED_MODEL_FILE
    names = [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]
    assert names[:len(PACKED_INPUTS)] == list(PACKED_INPUTS)
    fused = json.loads((shared.directory() / "export.json").read_text())["fused"]
    layers = tiny_base.model.config.num_hidden_layers
    assert fused["MultiHeadAttention"] == layers and fused["BiasGelu"] == layers
    assert fused["SkipLayerNormalization"] >= 2 * layers


def test_a_packed_batch_of_mixed_lengths_and_encoders_matches_per_row_torch(shared, pool):
    keys = [KEYS[i % len(KEYS)] for i in range(len(TEXTS))]
    texts = TEXTS + TEXTS[::-1]
    keys = keys + keys[::-1]
    got = shared.encode(texts, keys)
    assert cosine(got, _torch_rows(pool, texts, keys)).min() >= MIN_COSINE


@pytest.mark.parametrize("key", KEYS)
def test_a_row_gives_the_same_vector_alone_and_among_other_lengths(shared, key):
    batch = shared.encode(TEXTS, [key] * len(TEXTS))
    alone = np.concatenate([shared.encode([t], [key]) for t in TEXTS])
    assert cosine(batch, alone).min() >= MIN_COSINE
    np.testing.assert_allclose(batch, alone, atol=1e-5)


def test_merged_exports_are_packed_and_match_per_row_torch(pool, tiny_base, tmp_path):
    b = OnnxBackend(pool, tmp_path, threads=1)
    try:
        for k in ("l1@1", "b1@1", "p1@1"):   # p1: a partial encoder, its own weights merged
            b.prepare(k)
            assert b.wait(k, timeout=120), b.error(k)
            names = [i.name for i in onnx.load(str(b.directory(k) / MODEL_FILE), load_external_data=False).graph.input]
            assert names == list(PACKED_INPUTS)   # biases are constants in a merged graph
            got = b.encode(TEXTS, [k] * len(TEXTS))
            assert cosine(got, _torch_rows(pool, TEXTS, [k] * len(TEXTS))).min() >= MIN_COSINE
            alone = np.concatenate([b.encode([t], [k]) for t in TEXTS])
            np.testing.assert_allclose(got, alone, atol=1e-5)
    finally:
        b.close()


@pytest.mark.parametrize("arch, packed", [("xlm-roberta", True), ("distilbert", False)])
def test_only_bases_whose_attention_is_fused_run_packed(arch, packed, tmp_path):
    # DistilBERT's attention (q_lin/k_lin/v_lin) is not fused: packed, it would attend across rows.
    from qswap.encoders import load_base
    from qswap.encoders.runtime.packing import packable

    from .test_onnx import _other_arch

    base = load_base(_other_arch(tmp_path / arch, arch), device="cpu")
    assert packable(base.layout) is packed

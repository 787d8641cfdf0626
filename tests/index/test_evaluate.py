from __future__ import annotations

import numpy as np

from qswap.index import Document, IndexConfig, create_index, evaluate, synthetic_embeddings


def test_synthetic_embeddings_are_structured(other_space):
    x = synthetic_embeddings(2000, 64, seed=3)
    assert x.shape == (2000, 64) and x.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    var = x.var(axis=0)
    assert var[:16].mean() > 1.5 * var[-16:].mean()  # leading dimensions carry more (Matryoshka-like)
    assert np.array_equal(x, synthetic_embeddings(2000, 64, seed=3))


def test_evaluate_reports_recall_bytes_latency(tmp_path, other_space):
    space = other_space(dim=64)
    x = synthetic_embeddings(1500, 64, seed=1)
    docs = [Document(f"s{i}", f"synthetic {i}", {}) for i in range(len(x))]
    with create_index(tmp_path / "idx", docs, x, space, IndexConfig(kind="flat", quant="fp32")) as idx:
        exact = evaluate(idx, n_queries=100, latency_queries=20)
        assert exact["recall@10"] == 1.0 and exact["documents"] == 1500
        assert exact["bytes_per_doc"]["faiss"] >= 64 * 4 and exact["bytes_per_doc"]["embeddings"] == 128
        assert 0 < exact["latency_ms"]["p50"] <= exact["latency_ms"]["p99"]
        crude = evaluate(idx.with_config(IndexConfig(kind="ivf", quant="sq4", dim=8, nprobe=1, rescore=False)),
                         n_queries=100, latency_queries=20)
        assert crude["recall@10"] < 0.9
        assert crude["bytes_per_doc"]["faiss"] < exact["bytes_per_doc"]["faiss"] / 4
        rescored = evaluate(idx.with_config(IndexConfig(kind="flat", quant="sq8", oversample=4)),
                            n_queries=100, latency_queries=20)
        assert rescored["recall@10"] >= 0.98 and rescored["rescoring"]
        given = evaluate(idx, x[:30] + 0.01, latency_queries=5)
        assert given["queries"] == 30 and given["recall@10"] == 1.0

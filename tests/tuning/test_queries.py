"""A run's queries: tokenised once, encoded on the serving path's ONNX Runtime export with the
vectors torch gives (cosine >= 0.99999), base and tuned; the torch fallback is the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qswap.encoders import BASE_KEY, save_encoder, tokenize_batch
from qswap.tuning.methods import MethodConfig, QueryTower
from qswap.tuning.queries import FastQueries, QueryTokens

TEXTS = ["a", "search the index for a python library", "chess puzzle game with levels for linux",
         "the quick brown fox jumps over the lazy dog while the network server answers a query",
         "search the index for a python library"]   # a repeat: tokenised and encoded once


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


class CountingTokenizer:
    """The base's tokenizer, counting the texts it is asked to encode."""

    def __init__(self, inner):
        self.inner, self.texts = inner, 0

    def encode_batch(self, texts):
        self.texts += len(texts)
        return self.inner.encode_batch(texts)

    @property
    def padding(self):
        return self.inner.padding


def test_tokens_match_the_tokenizer_and_each_text_is_tokenised_once(tiny_base):
    tok = CountingTokenizer(tiny_base.tokenizer)
    memo = QueryTokens(tok, tiny_base.spec.query_prefix)
    ids, mask = memo.batch(TEXTS)
    ref_ids, ref_mask = tokenize_batch(tiny_base.tokenizer, TEXTS, tiny_base.spec.query_prefix)
    assert torch.equal(ids, ref_ids) and torch.equal(mask, ref_mask)
    memo.batch(TEXTS[:2])
    memo.ids(list(reversed(TEXTS)))
    assert tok.texts == len(set(TEXTS)) == len(memo)


@pytest.fixture(scope="module")
def tuned_dir(tiny_base, tmp_path_factory):
    """A partial encoder (every block's tensors changed), saved the way a run saves it."""
    tower = QueryTower(tiny_base, MethodConfig("partial"))
    with torch.no_grad():
        for _, p in tower.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    d = tmp_path_factory.mktemp("tuned") / "enc"
    exported = tower.export(d.parent)
    save_encoder(d, name="enc", version="1", kind=exported.kind, space=tiny_base.space, tensors=exported.tensors)
    return tower, d


def test_base_and_tuned_run_on_onnx_with_torch_vectors(tiny_base, tuned_dir, tmp_path):
    tower, d = tuned_dir
    fast = FastQueries(tiny_base, QueryTokens(tiny_base.tokenizer, tiny_base.spec.query_prefix), tmp_path / "onnx")
    try:
        base_vecs = fast.base_encoder()(TEXTS)
        key, encode = fast.tuned_encoder(d)
        tuned_vecs = encode(TEXTS)
        assert fast.runtime == {BASE_KEY: "onnx", key: "onnx"}
    finally:
        fast.close()
    assert _cos(base_vecs, tiny_base.encode_queries(TEXTS)).min() >= 0.99999
    ref = tower.encode(TEXTS)
    assert _cos(tuned_vecs, ref).min() >= 0.99999
    # the tuned encoder is not the base: the comparison above could tell them apart
    assert _cos(base_vecs, ref).min() < 0.999


def test_torch_runtime_is_the_reference_and_base_vectors_are_memoised(tiny_base, tmp_path):
    fast = FastQueries(tiny_base, QueryTokens(tiny_base.tokenizer, tiny_base.spec.query_prefix), tmp_path / "onnx",
                       enabled=False)
    calls = []
    inner = fast.pool.encode
    fast.pool.encode = lambda texts, keys: (calls.append(len(texts)), inner(texts, keys))[1]
    encode = fast.base_encoder()
    first = encode(TEXTS)
    again = encode(TEXTS[1:3])
    assert not (tmp_path / "onnx").exists() and fast.runtime.get(BASE_KEY, "").startswith("torch")
    np.testing.assert_allclose(first, tiny_base.encode_queries(TEXTS), atol=1e-6)
    np.testing.assert_array_equal(again, first[1:3])
    assert calls == [len(set(TEXTS))]      # one call, each distinct text once; the repeat came from the memo

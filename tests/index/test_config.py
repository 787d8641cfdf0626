from __future__ import annotations

import pytest

from qswap.errors import InvalidInputError
from qswap.index import IndexConfig
from qswap.index.backends.faiss.faiss_index import plan


def test_defaults_by_corpus_size():
    small = IndexConfig.for_corpus(10_000, 384)
    assert (small.kind, small.quant, small.dim) == ("flat", "fp32", 384)
    mid = IndexConfig.for_corpus(500_000, 384)
    assert (mid.kind, mid.quant, mid.dim) == ("hnsw", "sq8", 384)
    assert mid.rescore and mid.oversample >= 2
    big = IndexConfig.for_corpus(5_000_000, 384)
    assert (big.kind, big.quant, big.dim) == ("ivf", "sq8", 256)
    assert big.nlist == 8192 and big.nprobe >= 16  # 4 * sqrt(5M) ~ 8944 -> nearest power of two


def test_overrides_win_and_others_follow_size():
    c = IndexConfig(quant="sq4", dim=128).resolve(500_000, 384)
    assert (c.kind, c.quant, c.dim) == ("hnsw", "sq4", 128)


@pytest.mark.parametrize("kw", [
    {"quant": "int3"}, {"kind": "lsh"}, {"dim": 0}, {"nprobe": -1}, {"oversample": 1.5}, {"dim": 999},
    {"quant": "pq", "dim": 30, "pq_m": 7}, {"hnsw_m": 1},
])
def test_bad_options_are_named_errors(kw):
    with pytest.raises(InvalidInputError):
        IndexConfig(**kw).resolve(1000, 384)


def test_round_trip_and_unknown_fields():
    c = IndexConfig(kind="ivf", nlist=64).resolve(5000, 64)
    assert IndexConfig.from_dict(c.to_dict()) == c
    with pytest.raises(InvalidInputError, match="unknown index options"):
        IndexConfig.from_dict({**c.to_dict(), "warp_drive": 1})


def test_factory_strings_and_clamping():
    c = IndexConfig(kind="ivf", quant="sq8", nlist=1024).resolve(2000, 64)
    p = plan(c, 2000)
    # 2000 vectors can train at most 2000 // 39 = 51 lists
    assert p.factory == "IVF51,SQ8" and p.nlist == 51
    assert plan(IndexConfig(kind="hnsw", quant="fp16", hnsw_m=16).resolve(100, 64), 100).factory == \
        "IDMap2,HNSW16,SQfp16"
    pq = plan(IndexConfig(kind="flat", quant="pq", dim=32).resolve(20_000, 64), 20_000)
    assert pq.factory == "IDMap2,PQ4x8" and pq.pq_nbits == 8
    assert plan(IndexConfig(kind="flat", quant="pq").resolve(300, 64), 300).pq_nbits < 8

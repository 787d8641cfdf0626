"""The naive baseline's fast runtime: one merged ONNX graph per domain answers as the domain's model."""

from __future__ import annotations

import numpy as np

from qswap.bench import fixtures
from qswap.bench.fixtures import merged_models
from qswap.bench.naive_baseline import _OnnxDomain
from qswap.encoders import EncoderPool, load_encoder

QUERIES = ["chess puzzle game", "a python library for audio", "linux network server tool"]


def test_onnx_domain_equals_the_domains_lora_encoder(tiny_base, tmp_path, monkeypatch):
    monkeypatch.setenv("QSWAP_DATA_DIR", str(tmp_path / "data"))
    keys = [("d0", "1"), ("d1", "1")]
    root = fixtures.lora_encoders(tiny_base, keys, rank=4, scale=0.5)
    models = merged_models(tiny_base, root, keys)
    pool = EncoderPool(tiny_base)
    outs = {}
    for name, version in keys:
        pool.add(load_encoder(root / f"{name}-{version}", tiny_base.space))
        want = pool.encode(QUERIES, [f"{name}@{version}"] * len(QUERIES))
        dom = _OnnxDomain(models[name], threads=1)
        got = dom.encode([tiny_base.spec.query_prefix + q for q in QUERIES])
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cos.min() > 0.99999
        outs[name] = got
    # each domain really is its own model (the adapters differ, so do the answers)
    assert np.abs(outs["d0"] - outs["d1"]).max() > 1e-3
    # the base's table was copied per domain, not shared: a full model per domain is the naive way
    assert (models["d0"] / "onnx" / "model.onnx").is_file() and (models["d0"] / "model.safetensors").is_file()

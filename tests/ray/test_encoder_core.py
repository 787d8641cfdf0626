"""server/ray/encoder.py without a cluster: an encoder replica started on a state dir whose base
layout and shared export are cached serves the base without building its torch model, as the
single-process server does (no Ray needed: EncoderCore is the replica's plain body)."""

from __future__ import annotations

import numpy as np

from qswap.server.config import ServerSettings
from qswap.server.ray.encoder import EncoderCore

QUERIES = ["chess puzzle game", "music and sound"]


def _close(core: EncoderCore) -> None:
    core.registry.close()
    core.backend.close()


def test_a_replica_on_cached_exports_serves_without_the_torch_model(tmp_path, tiny_model_dir, tiny_base):
    s = ServerSettings(model=str(tiny_model_dir), device="cpu", state_dir=tmp_path / "state")
    first = EncoderCore(s)   # nothing cached: the model is built, the layout recorded, the graph exported
    try:
        assert first.base.built and first.backend.wait(timeout=300)
    finally:
        _close(first)
    again = EncoderCore(s)
    try:
        assert not again.base.built and again.backend.runtime("base") == "onnx-shared"
        vecs = again.backend.encode(QUERIES, ["base"] * len(QUERIES))
        assert not again.base.built
    finally:
        _close(again)
    ref = tiny_base.encode_queries(QUERIES)
    assert np.sum(np.asarray(vecs) * ref, axis=1).min() > 0.99999


def test_a_replica_stores_lora_factors_as_the_settings_say(tmp_path, tiny_model_dir):
    # The replica builds its pool with the single-process server's builder: a pool at the
    # default (float32) would hold twice the bytes the memory budget counts at half precision.
    for factors in ("float16", "bfloat16"):
        s = ServerSettings(model=str(tiny_model_dir), device="cpu", state_dir=tmp_path / factors,
                           lora_factors=factors)
        core = EncoderCore(s)
        try:
            assert core.pool.factor_dtype == factors
        finally:
            _close(core)

"""The bundled multilingual-e5-small (XLM-R): tuned towers export and serve exactly."""

from __future__ import annotations

import pytest

from qswap.encoders import EncoderPool, load_base, load_encoder, save_encoder
from qswap.tuning.methods import MethodConfig, QueryTower

from ..encoders.adapters import add_noise_


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["partial", "lora"])
def test_e5_export_is_served_as_trained(tmp_path, kind):
    base = load_base("multilingual-e5-small", device="cpu")
    tower = QueryTower(base, MethodConfig(kind, lora_rank=8, freeze_output_dense=kind == "partial"))
    add_noise_((p for _, p in tower.trainable_parameters()), 1e-3, 0)
    ex = tower.export(tmp_path)
    save_encoder(tmp_path / "enc", name=f"e5-{kind}", version="1", kind=ex.kind, space=base.space,
                 tensors=ex.tensors, lora_dir=ex.lora_dir)
    pool = EncoderPool(base)
    art = load_encoder(tmp_path / "enc", expected_space=base.space)
    pool.add(art)
    texts = ["Textbasierter E-Mail-Client", "lightweight text editor", "éditeur de texte léger"]
    served = pool.encode(texts, [art.key] * len(texts))
    assert abs(served - tower.encode(texts)).max() < 1e-4
    assert abs(served - base.encode_queries(texts)).max() > 1e-5
    if kind == "partial":
        assert not any(n.startswith("embeddings.") or n.endswith("layer.0.output.dense.weight") for n in ex.tensors)

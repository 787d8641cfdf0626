"""Which tensors each method trains, and what it exports for save_encoder."""

from __future__ import annotations

import pytest
import torch

from qswap.encoders import EncoderPool, load_encoder, save_encoder
from qswap.errors import InvalidInputError
from qswap.tuning.methods import MethodConfig, QueryTower, trainable_names

from ..encoders.adapters import add_noise_


def test_trainable_sets(tiny_base):
    m = tiny_base.model
    names = [n for n, _ in m.named_parameters()]
    partial = trainable_names(m, MethodConfig("partial"))
    assert not any(n.startswith("embeddings.") for n in partial)
    assert set(partial) == {n for n in names if n.startswith("encoder.")}
    full = trainable_names(m, MethodConfig("full"))
    assert set(full) == set(names)
    bias = trainable_names(m, MethodConfig("bias"))
    assert bias and all(n.endswith(".bias") and n.startswith("encoder.") for n in bias)
    k1 = trainable_names(m, MethodConfig("partial", freeze_blocks=1))
    assert k1 and all(n.startswith("encoder.layer.1.") for n in k1)
    od = trainable_names(m, MethodConfig("partial", freeze_output_dense=True))
    assert set(partial) - set(od) == {"encoder.layer.0.output.dense.weight", "encoder.layer.1.output.dense.weight"}


def test_bad_method_options_are_named_errors(tiny_base):
    with pytest.raises(InvalidInputError):
        MethodConfig("adapter").validate()
    with pytest.raises(InvalidInputError):
        MethodConfig("bias", freeze_blocks=1).validate()
    with pytest.raises(InvalidInputError, match="nothing to train"):
        QueryTower(tiny_base, MethodConfig("partial", freeze_blocks=2))


def test_the_tower_shares_frozen_tensors_with_the_base(tiny_base):
    tower = QueryTower(tiny_base, MethodConfig("partial"))
    base = dict(tiny_base.model.named_parameters())
    mine = dict(tower.model.named_parameters())
    assert mine["embeddings.word_embeddings.weight"] is base["embeddings.word_embeddings.weight"]
    assert mine["encoder.layer.0.output.dense.weight"] is not base["encoder.layer.0.output.dense.weight"]
    assert mine["encoder.layer.0.output.dense.weight"].requires_grad


def _perturb(tower: QueryTower, seed: int) -> None:
    add_noise_((p for _, p in tower.trainable_parameters()), 0.05, seed)


@pytest.mark.parametrize("kind,expected_kind", [("partial", "partial"), ("bias", "bias"), ("full", "partial"),
                                                ("lora", "lora")])
def test_export_reproduces_the_tower_through_the_pool(tiny_base, tmp_path, kind, expected_kind):
    tower = QueryTower(tiny_base, MethodConfig(kind, lora_rank=4))
    _perturb(tower, 1)
    ex = tower.export(tmp_path)
    assert ex.kind == expected_kind
    out = tmp_path / "enc"
    save_encoder(out, name=f"t-{kind}", version="1", kind=ex.kind, space=tiny_base.space,
                 tensors=ex.tensors, lora_dir=ex.lora_dir)
    pool = EncoderPool(tiny_base)
    art = load_encoder(out, expected_space=tiny_base.space)
    pool.add(art)
    texts = ["chess puzzle game", "linux server tool", "music audio"]
    served = pool.encode(texts, [art.key] * 3)
    base = tiny_base.encode_queries(texts)
    assert abs(served - tower.encode(texts)).max() < 1e-5
    assert abs(served - base).max() > 1e-3             # the adapter really changes the encoder
    if kind == "full":
        assert set(ex.tensors) == {n for n, _ in tiny_base.model.named_parameters()}


def test_bias_export_keeps_only_changed_biases(tiny_base, tmp_path):
    tower = QueryTower(tiny_base, MethodConfig("bias"))
    with torch.no_grad():
        dict(tower.model.named_parameters())["encoder.layer.1.output.dense.bias"].add_(0.1)
    assert list(tower.export(tmp_path).tensors) == ["encoder.layer.1.output.dense.bias"]
    with pytest.raises(InvalidInputError):
        QueryTower(tiny_base, MethodConfig("bias")).export(tmp_path)


def test_the_cli_offers_every_method_in_its_order():
    from qswap.tuning.choices import METHOD_NAMES
    from qswap.tuning.methods import METHODS
    assert tuple(METHODS) == METHOD_NAMES

"""Many encoders over one base: mixed batches, sharing, memory, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qswap.encoders import BASE_KEY, EncoderPool, load_base, load_encoder, save_encoder
from qswap.encoders.kinds.base import TENSOR_OBJECT_BYTES
from qswap.errors import ConflictError, InvalidInputError, NotFoundError, SpaceMismatchError

from .adapters import make_lora, make_overrides

TEXTS = ["chess puzzle game", "audio and music", "physics data", "the linux search server",
         "a tool for python", "math and science library", "video games", "network client"]


@pytest.fixture()
def pool_with_encoders(tiny_base, tmp_path):
    pool = EncoderPool(tiny_base)
    paths = {
        "l1": make_lora(tiny_base, tmp_path / "l1", "l1", seed=1),
        "l2": make_lora(tiny_base, tmp_path / "l2", "l2", seed=2, r=8, targets=("query", "key", "dense")),
        "b1": make_overrides(tiny_base, tmp_path / "b1", "b1", "bias", seed=3),
        "p1": make_overrides(tiny_base, tmp_path / "p1", "p1", "partial", seed=4),
    }
    for p in paths.values():
        pool.add(load_encoder(p, tiny_base.space))
    return pool


def test_identity_matches_base(tiny_base):
    pool = EncoderPool(tiny_base)
    got = pool.encode(TEXTS, [BASE_KEY] * len(TEXTS))
    np.testing.assert_allclose(got, tiny_base.encode_queries(TEXTS), atol=1e-6)


def test_mixed_batch_equals_rows_alone(pool_with_encoders):
    pool = pool_with_encoders
    keys = ["l1@1", "l2@1", "b1@1", "p1@1", BASE_KEY, "l1@1", "l2@1", "b1@1"]
    mixed = pool.encode(TEXTS, keys)
    alone = np.stack([pool.encode([t], [k])[0] for t, k in zip(TEXTS, keys)])
    assert np.abs(mixed - alone).max() <= 1e-5
    # and every adapter really changes the embedding
    base = pool.encode(TEXTS, [BASE_KEY] * len(TEXTS))
    for i, k in enumerate(keys):
        if k != BASE_KEY:
            assert np.abs(mixed[i] - base[i]).max() > 1e-3, k


def test_base_model_untouched_by_adapters(pool_with_encoders, tiny_base):
    before = tiny_base.encode_documents(TEXTS)
    pool_with_encoders.encode(TEXTS, ["l1@1"] * len(TEXTS))
    np.testing.assert_array_equal(before, tiny_base.encode_documents(TEXTS))
    assert not any(".lora_" in n for n, _ in tiny_base.model.named_parameters())


def test_lora_matches_peft_merged(pool_with_encoders, tiny_base):
    """The pool's LoRA forward equals the merged weights (what export uses)."""
    import copy
    merged = pool_with_encoders.merged_state_dict("l1@1")
    m = copy.deepcopy(tiny_base.model)
    m.load_state_dict(merged)
    from qswap.encoders import embed_batch, tokenize_batch
    ids, mask = tokenize_batch(tiny_base.tokenizer, TEXTS, tiny_base.spec.query_prefix)
    with torch.no_grad():
        ref = embed_batch(m, ids, mask, tiny_base.spec).numpy()
    got = pool_with_encoders.encode(TEXTS, ["l1@1"] * len(TEXTS))
    assert np.abs(ref - got).max() <= 1e-5


def test_memory_per_encoder_is_its_own_tensors_only(pool_with_encoders, tiny_base):
    base_bytes = sum(p.numel() * p.element_size() for p in tiny_base.model.parameters())
    for key in ("l1@1", "b1@1"):
        assert 0 < pool_with_encoders.memory_bytes(key) < 0.25 * base_bytes
    # partial = one block of two: under 60% of the base
    assert pool_with_encoders.memory_bytes("p1@1") < 0.6 * base_bytes
    # the pool shares the base's parameter storage (no copy)
    ptrs = {p.data_ptr() for p in tiny_base.model.parameters()}
    shared = list(pool_with_encoders._module.parameters())
    assert shared and all(p.data_ptr() in ptrs for p in shared)
    # and no encoder tensor lives in base storage
    for key in ("l1@1", "l2@1", "b1@1", "p1@1"):
        assert all(t.data_ptr() not in ptrs for t in pool_with_encoders.attached(key).tensors()), key


def test_remove_and_duplicates(pool_with_encoders, tiny_base, tmp_path):
    pool = pool_with_encoders
    with pytest.raises(ConflictError):
        pool.add(load_encoder(tmp_path / "l1", tiny_base.space))
    pool.remove("l1@1")
    with pytest.raises(NotFoundError):
        pool.encode(["x"], ["l1@1"])
    # others still work after a LoRA removal
    assert pool.encode(["x"], ["l2@1"]).shape == (1, tiny_base.dim)


def test_wrong_space_refused(tiny_base, other_tiny_model_dir, tmp_path):
    other = load_base(other_tiny_model_dir, device="cpu")
    make_overrides(other, tmp_path / "o", "o", "bias", seed=0)
    with pytest.raises(SpaceMismatchError) as e:
        load_encoder(tmp_path / "o", tiny_base.space)
    assert e.value.field == "weights_sha256"
    with pytest.raises(SpaceMismatchError):
        EncoderPool(tiny_base).add(load_encoder(tmp_path / "o"))


def test_adapter_for_other_architecture_refused(tiny_base, tmp_path):
    save_encoder(tmp_path / "x", name="x", version="1", kind="partial", space=tiny_base.space,
                 tensors={"encoder.layer.9.output.dense.weight": torch.zeros(3, 3)})
    with pytest.raises(InvalidInputError, match="another architecture"):
        EncoderPool(tiny_base).add(load_encoder(tmp_path / "x", tiny_base.space))
    big = {"encoder.layer.0.output.dense.weight": torch.zeros(5, 5)}
    save_encoder(tmp_path / "y", name="y", version="1", kind="partial", space=tiny_base.space, tensors=big)
    with pytest.raises(InvalidInputError, match="shape"):
        EncoderPool(tiny_base).add(load_encoder(tmp_path / "y", tiny_base.space))


def test_lora_targets_missing_refused(tiny_base, tmp_path):
    d = make_lora(tiny_base, tmp_path / "l", "l", seed=0)
    import json
    cfg = json.loads((d / "adapter_config.json").read_text())
    art = load_encoder(d, tiny_base.space)
    art.lora_config = {**cfg, "target_modules": ["q_proj", "v_proj"]}  # a Llama-style adapter
    with pytest.raises(InvalidInputError, match="does not fit"):
        EncoderPool(tiny_base).add(art)


def test_removing_the_last_lora_leaves_a_working_pool(tiny_base, tmp_path):
    pool = EncoderPool(tiny_base)
    pool.add(load_encoder(make_lora(tiny_base, tmp_path / "l", "l", seed=1), tiny_base.space))
    pool.add(load_encoder(make_overrides(tiny_base, tmp_path / "b", "b", "bias", seed=2), tiny_base.space))
    pool.remove("l@1")
    got = pool.encode(TEXTS[:2] * 2, [BASE_KEY, BASE_KEY, "b@1", "b@1"])
    np.testing.assert_allclose(got[:2], tiny_base.encode_queries(TEXTS[:2]), atol=1e-6)
    assert np.abs(got[2:] - got[:2]).max() > 1e-3
    # and LoRA can be added again afterwards
    pool.add(load_encoder(make_lora(tiny_base, tmp_path / "l2", "l2", seed=3), tiny_base.space))
    assert pool.encode(["x"], ["l2@1"]).shape == (1, tiny_base.dim)


def test_runtime_tensors_reproduce_each_encoder(pool_with_encoders, tiny_base):
    """What a fast runtime binds per encoder is enough to compute the encoder's own answers."""
    import copy
    from qswap.encoders import embed_batch, tokenize_batch
    pool = pool_with_encoders
    ids, mask = tokenize_batch(tiny_base.tokenizer, TEXTS, tiny_base.spec.query_prefix)
    assert pool.runtime_tensors(BASE_KEY) == {}
    for key in ("l1@1", "l2@1", "b1@1", "p1@1"):
        rt = pool.runtime_tensors(key)
        state = {n: p.detach().clone() for n, p in tiny_base.model.named_parameters()}
        if pool.attached(key).kind == "lora":
            modules = {n.rsplit(".", 1)[0] for n in rt}
            assert rt and all(f"{m}.lora_A" in rt and f"{m}.lora_B" in rt for m in modules)
            for m in modules:   # B carries the scaling: W + B @ A is the merged weight
                state[f"{m}.weight"] = state[f"{m}.weight"] + rt[f"{m}.lora_B"] @ rt[f"{m}.lora_A"]
        else:
            assert rt and set(rt) <= set(state)
            state.update(rt)
        m = copy.deepcopy(tiny_base.model)
        m.load_state_dict(state, strict=False)
        with torch.no_grad():
            ref = embed_batch(m, ids, mask, tiny_base.spec).numpy()
        assert np.abs(ref - pool.encode(TEXTS, [key] * len(TEXTS))).max() <= 1e-5, key
        # the bytes an encoder costs are those of the tensors it binds, and their objects
        assert pool.memory_bytes(key) == sum(t.numel() * t.element_size() for t in rt.values()) \
            + TENSOR_OBJECT_BYTES * len(rt), key


def test_detach_unbinds_only_that_encoder(pool_with_encoders, tiny_base):
    pool = pool_with_encoders

    def hooks() -> int:
        return sum(len(m._forward_hooks) for m in pool._module.modules())
    # per block, l1 adapts query, value; l2 query, key and the three dense layers: 6 layers hooked
    assert hooks() == 2 * 6
    l2 = pool.encode(TEXTS, ["l2@1"] * len(TEXTS))
    pool.remove("l1@1")
    assert hooks() == 2 * 5   # value is no longer adapted by anyone
    np.testing.assert_array_equal(pool.encode(TEXTS, ["l2@1"] * len(TEXTS)), l2)
    pool.remove("l2@1")
    assert hooks() == 0 and sorted(pool.keys()) == sorted([BASE_KEY, "b1@1", "p1@1"])
    np.testing.assert_allclose(pool.encode(TEXTS, [BASE_KEY] * len(TEXTS)), tiny_base.encode_queries(TEXTS),
                               atol=1e-6)


def test_lora_factors_packed_in_one_counted_block(tiny_base, tmp_path):
    """A LoRA encoder's factors live in one block of their own, and that block is what is counted:
    one storage for every factor, its bytes the encoder's count (no heap-scattered tensors)."""
    import mmap
    pool = EncoderPool(tiny_base, factor_dtype="float16")
    pool.add(load_encoder(make_lora(tiny_base, tmp_path / "l1", "l1", seed=1), tiny_base.space))
    factors = pool.runtime_tensors("l1@1").values()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in factors}
    assert len(storages) == 1 and all(t.dtype == torch.float16 and t.is_contiguous() for t in factors)
    own = sum(t.numel() * t.element_size() for t in factors)
    block = pool.memory_bytes("l1@1") - TENSOR_OBJECT_BYTES * len(factors)   # the rest: the tensors' objects
    assert block == next(iter(storages.values()))
    assert own <= block < own + 64 * len(factors) + mmap.PAGESIZE

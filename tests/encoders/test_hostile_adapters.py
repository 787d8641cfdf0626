"""Hostile and careless adapters: each is refused with a named 4xx-class error, and the pool is
exactly as it was (keys, hooks, the base model's state dict, and the scores of a reference query
with the base and with already-loaded LoRA / bias encoders, bit for bit)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from qswap.encoders import BASE_KEY, EncoderPool, load_encoder, read_encoder_manifest
from qswap.encoders.kinds import MAX_RANK
from qswap.errors import IntegrityError, InvalidInputError

from .adapters import lora_parts, make_lora, make_overrides, write_lora, write_raw_encoder, write_tensors

Q0 = "base_model.model.encoder.layer.0.attention.self.query"
V1 = "base_model.model.encoder.layer.1.attention.self.value"
REFERENCE = ["chess puzzle game", "the linux search server", "audio and music for python"]
Builder = Callable[[object, Path], Path]


def _lora(mutate_cfg=None, mutate_state=None, r: int = 4, targets=("query", "value")) -> Builder:
    def build(base, out: Path) -> Path:
        cfg, state = lora_parts(base, seed=7, r=r, targets=targets)
        if mutate_cfg is not None:
            cfg = mutate_cfg(cfg)
        if mutate_state is not None:
            mutate_state(state)
        return write_lora(base, out, "hostile", cfg, state)
    return build


def _set(**fields) -> Callable[[dict], dict]:
    return lambda cfg: {**cfg, **fields}


def _nan_at(key: str, value: float = float("nan")) -> Callable[[dict], None]:
    def mutate(state: dict) -> None:
        state[key] = state[key].clone()
        state[key].view(-1)[3] = value
    return mutate


def _tensors(kind: str, make: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Builder:
    def build(base, out: Path) -> Path:
        params = {n: p.detach().clone() for n, p in base.model.named_parameters()}
        return write_tensors(base, out, "hostile", kind, make(params))
    return build


def _with_inf(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    t = params["encoder.layer.0.output.dense.bias"]
    t[0] = float("inf")
    return {"encoder.layer.0.output.dense.bias": t}


HOSTILE: dict[str, tuple[Builder, type[Exception], str]] = {
    # keys: a base-model tensor smuggled into a LoRA file (it must never reach the base)
    "base-tensor-key": (_lora(mutate_state=lambda s: s.update(
        {"base_model.model.embeddings.LayerNorm.bias": torch.full((32,), 5.0)})), InvalidInputError, "not a LoRA factor"),
    "base-weight-key": (_lora(mutate_state=lambda s: s.update(
        {"base_model.model.encoder.layer.0.attention.self.query.weight": torch.zeros(32, 32)})),
        InvalidInputError, "not a LoRA factor"),
    "extra-lora-key-untargeted": (_lora(mutate_state=lambda s: s.update(
        {"base_model.model.encoder.layer.0.attention.self.key.lora_A.weight": torch.zeros(4, 32),
         "base_model.model.encoder.layer.0.attention.self.key.lora_B.weight": torch.zeros(32, 4)})),
        InvalidInputError, "do not name"),
    "adapter-named-key": (_lora(mutate_state=lambda s: s.update(
        {f"{Q0}.lora_A.default.weight": torch.zeros(4, 32)})), InvalidInputError, "not a LoRA factor"),
    "missing-lora-B": (_lora(mutate_state=lambda s: s.pop(f"{V1}.lora_B.weight")), InvalidInputError, "lacks lora_B"),
    "missing-module": (_lora(mutate_state=lambda s: [s.pop(f"{V1}.lora_{x}.weight") for x in "AB"]),
                       InvalidInputError, "no factors for target"),
    "empty-weights": (_lora(mutate_state=lambda s: s.clear()), InvalidInputError, "no tensors"),
    # shapes and ranks
    "wrong-rank": (_lora(mutate_cfg=_set(r=8)), InvalidInputError, "config says rank 8"),
    "wrong-in-features": (_lora(mutate_state=lambda s: s.update({f"{Q0}.lora_A.weight": torch.zeros(4, 16)})),
                          InvalidInputError, "the base layer needs"),
    "wrong-out-features": (_lora(mutate_state=lambda s: s.update({f"{Q0}.lora_B.weight": torch.zeros(64, 4)})),
                           InvalidInputError, "the base layer needs"),
    "three-dim-factor": (_lora(mutate_state=lambda s: s.update({f"{Q0}.lora_A.weight": torch.zeros(4, 32, 1)})),
                         InvalidInputError, "shapes"),
    "huge-r": (_lora(mutate_cfg=_set(r=4096)), InvalidInputError, f"outside 1..{MAX_RANK}"),
    "huge-r-real-tensors": (_lora(r=MAX_RANK + 1, targets=("query",)), InvalidInputError, f"outside 1..{MAX_RANK}"),
    "zero-r": (_lora(mutate_cfg=_set(r=0)), InvalidInputError, "outside"),
    # config types and unsupported fields
    "config-is-a-list": (_lora(mutate_cfg=lambda c: [c]), InvalidInputError, "not an object"),
    "config-is-a-number": (_lora(mutate_cfg=lambda c: 4), InvalidInputError, "not an object"),
    "r-as-string": (_lora(mutate_cfg=_set(r="4")), InvalidInputError, "not an integer"),
    "r-as-bool": (_lora(mutate_cfg=_set(r=True)), InvalidInputError, "not an integer"),
    "alpha-as-string": (_lora(mutate_cfg=_set(lora_alpha="8")), InvalidInputError, "lora_alpha"),
    "alpha-inf": (_lora(mutate_cfg=_set(lora_alpha=float("inf"))), InvalidInputError, "lora_alpha"),
    "targets-not-a-list": (_lora(mutate_cfg=_set(target_modules=5)), InvalidInputError, "target_modules"),
    "targets-empty": (_lora(mutate_cfg=_set(target_modules=[])), InvalidInputError, "target_modules"),
    "targets-unknown": (_lora(mutate_cfg=_set(target_modules=["q_proj", "v_proj"])), InvalidInputError,
                        "match no layer"),
    "targets-not-linear": (_lora(mutate_cfg=_set(target_modules=["query", "value", "LayerNorm"])),
                           InvalidInputError, "not a Linear"),
    "targets-catastrophic-regex": (_lora(mutate_cfg=_set(target_modules="(.*a+)+query")), InvalidInputError,
                                   "too complex"),
    "targets-bad-regex": (_lora(mutate_cfg=_set(target_modules="(query")), InvalidInputError, "regular expression"),
    "modules-to-save": (_lora(mutate_cfg=_set(modules_to_save=["word_embeddings"])), InvalidInputError,
                        "modules_to_save"),
    "use-dora": (_lora(mutate_cfg=_set(use_dora=True)), InvalidInputError, "use_dora"),
    "peft-type-ia3": (_lora(mutate_cfg=_set(peft_type="IA3")), InvalidInputError, "not LoRA"),
    "bias-all": (_lora(mutate_cfg=_set(bias="all")), InvalidInputError, "bias"),
    "fan-in-fan-out": (_lora(mutate_cfg=_set(fan_in_fan_out=True)), InvalidInputError, "fan_in_fan_out"),
    "rank-pattern": (_lora(mutate_cfg=_set(rank_pattern={"query": 8})), InvalidInputError, "rank_pattern"),
    "layers-to-transform": (_lora(mutate_cfg=_set(layers_to_transform=[0])), InvalidInputError,
                            "layers_to_transform"),
    "pissa-init": (_lora(mutate_cfg=_set(init_lora_weights="pissa")), InvalidInputError, "rewrites the base"),
    "unknown-field": (_lora(mutate_cfg=_set(future_switch={"on": True})), InvalidInputError, "future_switch"),
    # values
    "lora-nan": (_lora(mutate_state=_nan_at(f"{Q0}.lora_B.weight")), InvalidInputError, "NaN or Inf"),
    "lora-inf": (_lora(mutate_state=_nan_at(f"{V1}.lora_A.weight", float("-inf"))), InvalidInputError, "NaN or Inf"),
    "lora-int-dtype": (_lora(mutate_state=lambda s: s.update(
        {f"{Q0}.lora_A.weight": torch.zeros(4, 32, dtype=torch.int32)})), InvalidInputError, "not floating"),
    "bias-inf": (_tensors("bias", _with_inf), InvalidInputError, "NaN or Inf"),
    # finite values that overflow: caught from the scaled factors, or by the probe forward
    "alpha-overflows-scaling": (_lora(mutate_cfg=_set(lora_alpha=1e308, r=2), r=2), InvalidInputError, "NaN or Inf"),
    "lora-huge-values": (_lora(mutate_state=lambda s: s.update({f"{Q0}.lora_B.weight": torch.full((32, 4), 1.6e38)})),
                         InvalidInputError, "embeds queries to NaN/Inf"),
    "bias-huge-values": (_tensors("bias", lambda p: {"encoder.layer.0.output.dense.bias": torch.full((32,), 3e38)}),
                         InvalidInputError, "embeds queries to NaN/Inf"),
    "partial-nan": (_tensors("partial", lambda p: {"encoder.layer.1.output.dense.weight":
                                                   p["encoder.layer.1.output.dense.weight"] * float("nan")}),
                    InvalidInputError, "NaN or Inf"),
    # bias / partial keys and shapes
    "bias-holds-a-weight": (_tensors("bias", lambda p: {"encoder.layer.0.output.dense.weight":
                                                        p["encoder.layer.0.output.dense.weight"]}),
                            InvalidInputError, "cannot hold"),
    "partial-unknown-name": (_tensors("partial", lambda p: {"encoder.layer.7.output.dense.weight": torch.zeros(3)}),
                             InvalidInputError, "does not exist"),
    "partial-buffer-name": (_tensors("partial", lambda p: {"embeddings.position_ids": torch.zeros(1, 64)}),
                            InvalidInputError, "does not exist"),
    "partial-wrong-shape": (_tensors("partial", lambda p: {"encoder.layer.0.output.dense.bias": torch.zeros(31)}),
                            InvalidInputError, "shape"),
    "partial-int-dtype": (_tensors("partial", lambda p: {"encoder.layer.0.output.dense.bias":
                                                         torch.zeros(32, dtype=torch.int64)}),
                          InvalidInputError, "not floating"),
    "partial-empty": (_tensors("partial", lambda p: {}), InvalidInputError, "no tensors"),
    "not-safetensors": (lambda base, out: write_raw_encoder(base, out, "hostile", "bias",
                                                            {"adapter.safetensors": b"\x08" + b"\0" * 7 + b"{}"}),
                        IntegrityError, "corrupt"),
    "config-not-json": (lambda base, out: write_raw_encoder(base, out, "hostile", "lora", {
        "adapter_config.json": b"{", "adapter_model.safetensors": b""}), IntegrityError, "corrupt"),
    "config-deeply-nested": (lambda base, out: write_raw_encoder(base, out, "hostile", "lora", {
        "adapter_config.json": b"[" * 100_000 + b"]" * 100_000, "adapter_model.safetensors": b""}),
        IntegrityError, "corrupt"),
}


def _state(pool: EncoderPool, base) -> dict[str, object]:
    """Everything a refused encoder must leave unchanged."""
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in pool._module.modules())
    scores = {k: pool.encode(REFERENCE, [k] * len(REFERENCE)) for k in (BASE_KEY, "ref@1", "refb@1")}
    mixed = pool.encode(REFERENCE, [BASE_KEY, "ref@1", "refb@1"])
    return {"keys": pool.keys(), "hooks": hooks, "bytes": {k: pool.memory_bytes(k) for k in pool.keys()},
            "base": {n: t.clone() for n, t in base.model.state_dict().items()},
            "module": {n: t.clone() for n, t in pool._module.state_dict().items()},
            "scores": scores, "mixed": mixed, "documents": base.encode_documents(REFERENCE)}


def _assert_same(before: dict[str, object], after: dict[str, object]) -> None:
    assert after["keys"] == before["keys"] and after["hooks"] == before["hooks"]
    assert after["bytes"] == before["bytes"]
    for what in ("base", "module"):
        assert after[what].keys() == before[what].keys()
        for n, t in before[what].items():
            assert torch.equal(after[what][n], t), f"{what} tensor {n} changed"
    for k, v in before["scores"].items():
        np.testing.assert_array_equal(after["scores"][k], v, err_msg=k)
    np.testing.assert_array_equal(after["mixed"], before["mixed"])
    np.testing.assert_array_equal(after["documents"], before["documents"])


@pytest.fixture()
def loaded_pool(tiny_base, tmp_path):
    """A pool with a LoRA encoder on the layers the hostile adapters target, and a bias encoder."""
    pool = EncoderPool(tiny_base)
    pool.add(load_encoder(make_lora(tiny_base, tmp_path / "ref", "ref", seed=1, targets=("query", "value")),
                          tiny_base.space))
    pool.add(load_encoder(make_overrides(tiny_base, tmp_path / "refb", "refb", "bias", seed=2), tiny_base.space))
    return pool


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_adapter_refused_and_pool_unchanged(case, loaded_pool, tiny_base, tmp_path):
    build, error, message = HOSTILE[case]
    path = build(tiny_base, tmp_path / "hostile")
    before = _state(loaded_pool, tiny_base)
    with pytest.raises(error, match=message) as e:
        loaded_pool.add(load_encoder(path, tiny_base.space))
    assert e.value.hint, "every refusal says what to do"
    _assert_same(before, _state(loaded_pool, tiny_base))
    # and the pool still takes a good encoder afterwards, on the same layers
    loaded_pool.add(load_encoder(make_lora(tiny_base, tmp_path / "good", "good", seed=3), tiny_base.space))
    assert np.abs(loaded_pool.encode(REFERENCE, ["good@1"] * 3) - before["scores"][BASE_KEY]).max() > 1e-3


def _in_memory(art, **changes):
    for k, v in changes.items():
        setattr(art, k, v)
    return art


IN_MEMORY = {
    # an artifact changed after load (or built by code, not read from disk) is checked again at attach
    "base-tensor-key": lambda a: _in_memory(a, lora_state={
        **a.lora_state, "base_model.model.embeddings.LayerNorm.bias": torch.full((32,), 5.0)}),
    "modules-to-save": lambda a: _in_memory(a, lora_config={**a.lora_config, "modules_to_save": ["word_embeddings"]}),
    "nan": lambda a: _in_memory(a, lora_state={k: v * float("nan") for k, v in a.lora_state.items()}),
    "config-list": lambda a: _in_memory(a, lora_config=[a.lora_config]),
    "r-string": lambda a: _in_memory(a, lora_config={**a.lora_config, "r": "4"}),
    "huge-r": lambda a: _in_memory(a, lora_config={**a.lora_config, "r": 4096}),
}


@pytest.mark.parametrize("case", list(IN_MEMORY))
def test_attach_checks_again_in_memory(case, loaded_pool, tiny_base, tmp_path):
    art = load_encoder(make_lora(tiny_base, tmp_path / "m", "m", seed=5), tiny_base.space)
    before = _state(loaded_pool, tiny_base)
    with pytest.raises(InvalidInputError):
        loaded_pool.add(IN_MEMORY[case](art))
    _assert_same(before, _state(loaded_pool, tiny_base))


def test_huge_rank_refused_before_reading_tensors(tiny_base, tmp_path, monkeypatch):
    """A declared rank over the limit is refused from the config and the file header alone."""
    path = _lora(mutate_cfg=_set(r=4096))(tiny_base, tmp_path / "h")
    wrong = _lora(mutate_cfg=_set(r=8))(tiny_base, tmp_path / "w")
    import safetensors.torch as st

    def no_read(*a, **k):
        raise AssertionError("tensor data read before the rank was checked")
    monkeypatch.setattr(st, "load_file", no_read)
    with pytest.raises(InvalidInputError, match="outside 1..256"):
        load_encoder(path, tiny_base.space)
    # shapes disagreeing with the declared rank are caught from the header too
    with pytest.raises(InvalidInputError, match="config says rank 8"):
        load_encoder(wrong, tiny_base.space)


@pytest.mark.parametrize("name,why", [("manifest.json", "the manifest itself"), ("a\x00b", "NUL"),
                                      ("x" * 256, "over 255 bytes"), ("../up", "path"), (".hidden", "hidden"),
                                      ("\udc00", "not valid Unicode"), ("", "empty")])
def test_manifest_with_a_bad_file_name_refused(tiny_base, tmp_path, name, why):
    d = write_raw_encoder(tiny_base, tmp_path / "m", "m", "identity", {}, manifest_files={name: "0" * 64})
    with pytest.raises(IntegrityError, match="not a valid encoder manifest") as e:
        read_encoder_manifest(d)
    assert why in str(e.value) and e.value.hint
    with pytest.raises(IntegrityError):
        load_encoder(d, tiny_base.space)


def test_manifest_with_unknown_kind_refused(tiny_base, tmp_path):
    d = write_raw_encoder(tiny_base, tmp_path / "m", "m", "magic", {})
    with pytest.raises(IntegrityError, match="unknown encoder kind 'magic'"):
        read_encoder_manifest(d)


def test_supported_lora_variants_load_and_match_merged(tiny_base, tmp_path):
    """What is accepted really works: rsLoRA scaling, a regex target, 'all-linear', fp16 factors."""
    import copy

    from qswap.encoders import embed_batch, tokenize_batch
    pool = EncoderPool(tiny_base)
    variants = {
        "rs": _lora(mutate_cfg=_set(use_rslora=True)),
        "rx": _lora(mutate_cfg=_set(target_modules=r".*\.(query|value)")),
        "al": _lora(targets=("query", "key", "value", "dense"), mutate_cfg=_set(target_modules="all-linear")),
        "half": _lora(mutate_state=lambda s: s.update({k: v.half() for k, v in s.items()})),
    }
    ids, mask = tokenize_batch(tiny_base.tokenizer, REFERENCE, tiny_base.spec.query_prefix)
    for name, build in variants.items():
        art = load_encoder(build(tiny_base, tmp_path / name), tiny_base.space)
        art.manifest = art.manifest.model_copy(update={"name": name})
        pool.add(art)
        m = copy.deepcopy(tiny_base.model)
        m.load_state_dict(pool.merged_state_dict(f"{name}@1"))
        with torch.no_grad():
            ref = embed_batch(m, ids, mask, tiny_base.spec).numpy()
        got = pool.encode(REFERENCE, [f"{name}@1"] * 3)
        assert np.abs(ref - got).max() <= 1e-5, name
    # rsLoRA scales by alpha/sqrt(r): 8/2 = 4, plain LoRA by alpha/r = 2
    assert pool.attached("rs@1").info["scaling"] == pytest.approx(4.0)
    assert pool.attached("al@1").info["modules"] == 12    # 6 Linear layers x 2 blocks

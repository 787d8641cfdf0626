"""Encoder directories: manifests, checksums, refusals with named errors."""

from __future__ import annotations

import json

import pytest
import torch

from qswap.encoders import load_base, load_encoder, read_encoder_manifest, save_encoder
from qswap.errors import IntegrityError, InvalidInputError, NotFoundError, SpaceMismatchError

from .adapters import make_lora, make_overrides


def test_roundtrip_each_kind(tiny_base, tmp_path):
    make_lora(tiny_base, tmp_path / "l", "l", seed=0)
    make_overrides(tiny_base, tmp_path / "b", "b", "bias", seed=0)
    save_encoder(tmp_path / "i", name="i", version="1", kind="identity", space=tiny_base.space)
    for d, kind in (("l", "lora"), ("b", "bias"), ("i", "identity")):
        art = load_encoder(tmp_path / d, tiny_base.space)
        assert art.manifest.kind == kind and art.key == f"{d}@1"
        assert set(art.manifest.files) == {p.name for p in (tmp_path / d).iterdir()} - {"manifest.json"}
    assert (tmp_path / "l" / "adapter_config.json").exists()  # peft's own format


def test_peft_written_adapter_loads_unchanged(tiny_base, tmp_path):
    """A LoRA directory written by peft itself (no qswap manifest) is wrapped, not converted."""
    import copy
    from peft import LoraConfig, get_peft_model
    m = get_peft_model(copy.deepcopy(tiny_base.model), LoraConfig(r=2, target_modules=["query"]))
    m.save_pretrained(str(tmp_path / "peft"))
    before = (tmp_path / "peft" / "adapter_model.safetensors").read_bytes()
    save_encoder(tmp_path / "e", name="e", version="1", kind="lora", space=tiny_base.space,
                 lora_dir=tmp_path / "peft")
    assert (tmp_path / "e" / "adapter_model.safetensors").read_bytes() == before


def test_missing_file(tiny_base, tmp_path):
    d = make_overrides(tiny_base, tmp_path / "b", "b", "bias", seed=0)
    (d / "adapter.safetensors").unlink()
    with pytest.raises(IntegrityError, match="missing"):
        load_encoder(d, tiny_base.space)


def test_checksum_mismatch(tiny_base, tmp_path):
    d = make_overrides(tiny_base, tmp_path / "b", "b", "bias", seed=0)
    f = d / "adapter.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="checksum"):
        load_encoder(d, tiny_base.space)


def test_corrupt_adapter_with_matching_manifest(tiny_base, tmp_path):
    """A file that is not safetensors at all, even with a correct checksum, is a named error."""
    d = make_overrides(tiny_base, tmp_path / "b", "b", "bias", seed=0)
    (d / "adapter.safetensors").write_bytes(b"not a tensor file")
    m = json.loads((d / "manifest.json").read_text())
    from qswap.atomic import sha256_file
    m["files"]["adapter.safetensors"] = sha256_file(d / "adapter.safetensors")
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IntegrityError, match="corrupt"):
        load_encoder(d, tiny_base.space)


def test_corrupt_manifest(tiny_base, tmp_path):
    d = make_overrides(tiny_base, tmp_path / "b", "b", "bias", seed=0)
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(IntegrityError, match="not a valid encoder manifest"):
        read_encoder_manifest(d)
    with pytest.raises(NotFoundError):
        load_encoder(tmp_path / "nowhere")


def test_wrong_base_fingerprint(tiny_base, other_tiny_model_dir, tmp_path):
    other = load_base(other_tiny_model_dir, device="cpu")
    save_encoder(tmp_path / "o", name="o", version="1", kind="identity", space=other.space)
    with pytest.raises(SpaceMismatchError, match="weights_sha256") as e:
        load_encoder(tmp_path / "o", tiny_base.space)
    assert "use a query encoder built on" in e.value.hint


def test_bad_names_and_kinds(tiny_base, tmp_path):
    with pytest.raises(InvalidInputError):
        save_encoder(tmp_path / "x", name="../evil", version="1", kind="identity", space=tiny_base.space)
    with pytest.raises(InvalidInputError):
        save_encoder(tmp_path / "x", name="x", version="1", kind="magic", space=tiny_base.space)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        save_encoder(tmp_path / "x", name="x", version="1", kind="bias", space=tiny_base.space, tensors={})


def test_unknown_bundled_name():
    with pytest.raises(NotFoundError, match="unknown bundled model"):
        load_base("no-such-model")
    with pytest.raises(NotFoundError, match="does not exist"):
        load_base("./no/such/dir")


def test_save_is_atomic_over_existing(tiny_base, tmp_path):
    """A failing save leaves the previous encoder directory intact."""
    d = make_overrides(tiny_base, tmp_path / "b", "b", "bias", seed=0)
    before = (d / "manifest.json").read_text()
    with pytest.raises(NotFoundError):
        save_encoder(d, name="b", version="2", kind="lora", space=tiny_base.space, lora_dir=tmp_path / "none")
    assert (d / "manifest.json").read_text() == before
    assert load_encoder(d, tiny_base.space).key == "b@1"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".b.")]


def test_matryoshka_truncate():
    import numpy as np
    from qswap.encoders import truncate
    x = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
    y = truncate(x, 4)
    assert y.shape == (5, 4)
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(y * np.linalg.norm(x[:, :4], axis=1, keepdims=True), x[:, :4], rtol=1e-5)
    t = truncate(torch.from_numpy(x), 4)
    np.testing.assert_allclose(t.numpy(), y, rtol=1e-6)
    with pytest.raises(InvalidInputError):
        truncate(x, 9)


def test_base_pooling_and_length_sorting_keep_order(tiny_base):
    texts = ["a", "a much longer text about chess and games and music " * 3, "b c"]
    together = tiny_base.encode_documents(texts, batch_size=1)
    singles = [tiny_base.encode_documents([t])[0] for t in texts]
    for a, b in zip(together, singles):
        assert float(abs(a - b).max()) < 1e-5
    # truncation at max length does not fail on very long input
    long = tiny_base.encode_queries(["word " * 500])
    assert long.shape == (1, tiny_base.dim)


def test_length_sorted_batches_group_by_real_length(tiny_base):
    """Batches group texts of similar token length (padding does not hide the length)."""
    from qswap.encoders.embedding import sorted_batches
    texts = ["a"] * 4 + ["chess " * 30] * 4
    texts = [t for pair in zip(texts[:4], texts[4:]) for t in pair]  # interleave short/long
    batches = list(sorted_batches(tiny_base.tokenizer, texts, "", batch_size=4))
    assert [sorted(len(texts[i]) for i in b) for b, _, _ in batches] == [[180] * 4, [1] * 4]
    # the short batch is cut to its own width (3 tokens: [CLS] a [SEP]), not the longest text's
    assert batches[1][1].shape == (4, 3) and batches[1][2].sum().item() == 12


def test_encoder_directory_is_readable_by_a_server_user(tiny_base, tmp_path):
    d = make_lora(tiny_base, tmp_path / "l", "l", seed=0)
    assert d.stat().st_mode & 0o005 == 0o005
    for f in d.iterdir():
        assert f.stat().st_mode & 0o004, f.name


def test_kind_plugins_registry_and_their_save_checks(tiny_base, tmp_path):
    from qswap.encoders.kinds import KINDS, AdapterKind, get_kind
    assert set(KINDS) == {"identity", "lora", "bias", "partial"}
    assert all(isinstance(k, AdapterKind) and k.name == name for name, k in KINDS.items())
    with pytest.raises(InvalidInputError, match="unknown encoder kind"):
        get_kind("magic")
    w = {"encoder.layer.0.output.dense.weight": torch.zeros(32, 64)}
    with pytest.raises(InvalidInputError, match="cannot hold"):
        save_encoder(tmp_path / "b", name="b", version="1", kind="bias", space=tiny_base.space, tensors=w)
    with pytest.raises(InvalidInputError, match="lora_dir"):
        save_encoder(tmp_path / "l", name="l", version="1", kind="lora", space=tiny_base.space)
    assert not (tmp_path / "b").exists() and not (tmp_path / "l").exists()
    # the same tensor is a valid partial encoder
    save_encoder(tmp_path / "p", name="p", version="1", kind="partial", space=tiny_base.space, tensors=w)
    assert load_encoder(tmp_path / "p", tiny_base.space).overrides.keys() == w.keys()


def test_complete_encoder_publishes_a_draft_without_rewriting_it(tiny_base, tmp_path):
    from qswap.encoders import complete_encoder

    draft = make_overrides(tiny_base, tmp_path / "work" / "draft", "d", "bias", seed=3)
    tensors = {n: (draft / n).read_bytes() for n in read_encoder_manifest(draft).files}
    (tmp_path / "report.md").write_text("# report")
    out = tmp_path / "enc"
    m = complete_encoder(draft, out, training={"steps": 3}, guard={"passed": True, "checks": []},
                         extra_files=[tmp_path / "report.md"])
    assert not draft.exists()                                          # consumed: moved, not copied
    art = load_encoder(out, tiny_base.space)                           # checksums verify
    assert art.manifest.training == {"steps": 3} and art.manifest.guard["passed"] is True
    assert set(m.files) == set(tensors) | {"report.md"}
    assert all((out / n).read_bytes() == b for n, b in tensors.items())

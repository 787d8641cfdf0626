"""encoders/layout.py and the lazy torch module of encoders/base.py: a base loaded with a recorded layout
serves the ONNX runtimes from its checkpoint and builds the torch module only when asked, once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from qswap.encoders.base import load_base
from qswap.encoders.layout import LAYOUT_DIR

QUERIES = ["chess puzzle game", "music and sound", "a"]


def _records(cache: Path) -> list[Path]:
    return sorted((cache / LAYOUT_DIR).glob("*.json"))


def test_warm_load_reads_tensors_without_building_the_model(tmp_path, tiny_model_dir, tiny_base):
    cache = tmp_path / "onnx"
    cold = load_base(tiny_model_dir, device="cpu", cache_dir=cache)
    assert cold.built and len(_records(cache)) == 1   # no record yet: built at once, and recorded
    warm = load_base(tiny_model_dir, device="cpu", cache_dir=cache)
    assert not warm.built
    assert warm.space == tiny_base.space
    assert warm.tokenizer.to_str() == tiny_base.tokenizer.to_str()
    assert warm.layout.linear == cold.layout.linear and warm.layout.norm == cold.layout.norm
    assert warm.layout.parameters == sum(p.numel() for p in tiny_base.model.parameters())
    table = warm.word_embeddings()
    biases = {n: warm.tensor(n) for n in warm.layout.bias_names()}
    assert torch.equal(table, tiny_base.model.get_input_embeddings().weight)
    assert all(torch.equal(t, tiny_base.model.get_parameter(n)) for n, t in biases.items())
    assert not warm.built

    # Several threads asking at once get one module, which holds the tensors handed out before.
    got: list[torch.nn.Module] = []
    start = threading.Barrier(4)

    def ask() -> None:
        start.wait()
        got.append(warm.model)
    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 4 and all(m is got[0] for m in got) and warm.built
    assert got[0].get_input_embeddings().weight.data_ptr() == table.data_ptr()
    assert all(got[0].get_parameter(n).data_ptr() == t.data_ptr() for n, t in biases.items())
    assert np.array_equal(warm.encode_queries(QUERIES), tiny_base.encode_queries(QUERIES))


def test_a_warm_load_opens_the_checkpoint_once_and_hashes_nothing(tmp_path, tiny_model_dir, monkeypatch):
    """A start on a recorded layout reads every tensor the runtimes ask for with one open of the
    weights file, and takes the weights' hash from the cache instead of reading the file."""
    import safetensors

    import qswap.atomic

    cache = tmp_path / "onnx"
    load_base(tiny_model_dir, device="cpu", cache_dir=cache)
    monkeypatch.setattr(qswap.atomic, "_sha_memo", {})   # as in a new process
    hashed: list[Path] = []
    real_sha = qswap.atomic.sha256_file
    monkeypatch.setattr(qswap.atomic, "sha256_file", lambda p, *a: hashed.append(Path(p)) or real_sha(p, *a))
    opened: list[str] = []
    real_open = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda f, *a, **k: opened.append(f) or real_open(f, *a, **k))
    warm = load_base(tiny_model_dir, device="cpu", cache_dir=cache)
    assert not warm.built and hashed == []
    names = [warm.layout.word_embeddings, *warm.layout.bias_names()]
    assert len(names) > 10
    tensors = {n: warm.tensor(n) for n in names}
    assert opened == [str(tiny_model_dir / "model.safetensors")]
    assert all(warm.tensor(n) is t for n, t in tensors.items())   # read once, handed out again


def test_a_record_of_other_weights_is_not_used(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cache = tmp_path / "onnx"
    load_base(model, device="cpu", cache_dir=cache)
    state = load_file(str(model / "model.safetensors"))
    name = "encoder.layer.0.attention.self.query.bias"
    state[name] = state[name] + 1.0
    save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    changed = load_base(model, device="cpu", cache_dir=cache)
    assert changed.built   # the record is keyed by the weights: built now, from the new file
    assert torch.equal(changed.tensor(name), state[name])
    assert len(_records(cache)) == 2


def test_no_record_where_the_tensors_are_not_in_safetensors(tmp_path, tiny_model_dir, tiny_base):
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, model / f.name)
    torch.save(tiny_base.model.state_dict(), model / "pytorch_model.bin")
    cache = tmp_path / "onnx"
    assert load_base(model, device="cpu", cache_dir=cache).built
    assert _records(cache) == []
    assert load_base(model, device="cpu", cache_dir=cache).built   # every load builds, as without a cache


def test_serving_from_cached_exports_imports_no_transformers(tmp_path, tiny_model_dir, tiny_base):
    """A fresh process with the record and the shared export cached answers queries on the shared graph
    without importing ``transformers`` (its modelling code is most of a server's start)."""
    from qswap.encoders import EncoderPool
    from qswap.encoders.runtime.shared import SharedBackend

    cache = tmp_path / "onnx"
    first = SharedBackend(EncoderPool(load_base(tiny_model_dir, device="cpu", cache_dir=cache)), cache)
    try:
        assert first.wait(timeout=300)
    finally:
        first.close()
    script = f"""
import json, sys
from pathlib import Path
from qswap.encoders import EncoderPool
from qswap.encoders.base import load_base
from qswap.encoders.runtime.shared import SharedBackend
base = load_base(Path({str(tiny_model_dir)!r}), device="cpu", cache_dir=Path({str(cache)!r}))
backend = SharedBackend(EncoderPool(base), Path({str(cache)!r}))
try:
    ready = backend.wait(timeout=120)
    backend.prepare("base")
    vecs = backend.encode({QUERIES!r}, ["base"] * {len(QUERIES)})
    runtime = backend.runtime("base")
finally:
    backend.close()
print(json.dumps({{"ready": ready, "runtime": runtime, "built": base.built, "vecs": vecs.tolist(),
                  "transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers")}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["ready"] and res["runtime"] == "onnx-shared" and not res["built"]
    assert res["transformers"] == []
    ref = tiny_base.encode_queries(QUERIES)
    assert np.sum(np.asarray(res["vecs"]) * ref, axis=1).min() > 0.99999


def test_the_word_embedding_array_is_the_checkpoint_s_tensor(tmp_path, tiny_model_dir, tiny_base):
    """load_array maps the word embeddings from the safetensors file without torch: bitwise the
    tensor torch reads, and None for a dtype numpy has no type for."""
    from dataclasses import replace

    from qswap.encoders.layout import load_array

    cache = tmp_path / "onnx"
    load_base(tiny_model_dir, device="cpu", cache_dir=cache)
    warm = load_base(tiny_model_dir, device="cpu", cache_dir=cache)
    name = warm.layout.word_embeddings
    array = load_array(warm.path, warm.layout, name)
    assert array is not None and not array.flags.writeable
    assert np.array_equal(array, tiny_base.model.get_input_embeddings().weight.detach().numpy())
    assert not warm.built
    bf16 = tmp_path / "bf16"
    shutil.copytree(tiny_model_dir, bf16)
    from safetensors.torch import save_file
    save_file({k: v.to(torch.bfloat16) for k, v in tiny_base.model.state_dict().items()}, str(bf16 / "model.safetensors"))
    layout = replace(warm.layout, sources={name: ("model.safetensors", name, "bfloat16")})
    assert load_array(bf16, layout, name) is None

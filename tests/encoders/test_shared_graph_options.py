"""The shared graph's export with LoRA inputs on a subset of the Linears (the others plain base
projections, their biases still inputs): run through ONNX Runtime with an encoder's inputs and
compared with the torch pool (cosine >= 0.99999)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from qswap.encoders import BASE_KEY, EncoderPool, load_encoder
from qswap.encoders.embedding import length_buckets
from qswap.encoders.runtime.onnx import make_session
from qswap.encoders.runtime.shared_adapters import adapter_inputs
from qswap.encoders.runtime.shared_export import SEGMENTS_MODEL_FILE, SHARED_MODEL_FILE, export_shared, find_slots

from .adapters import make_lora, make_overrides
from .test_shared import MIN_COSINE, TEXTS, cosine

QV = ("query", "value")


@pytest.fixture(scope="module")
def pool(tiny_base, tmp_path_factory):
    """LoRA on every Linear, LoRA on query/value only, and a bias encoder."""
    tmp = tmp_path_factory.mktemp("options")
    pool = EncoderPool(tiny_base)
    every = ("query", "key", "value", "dense")
    for d in (make_lora(tiny_base, tmp / "a4", "all4", seed=1, r=4, targets=every),
              make_lora(tiny_base, tmp / "qv", "qv", seed=3, r=4, targets=QV),
              make_overrides(tiny_base, tmp / "b", "bias", "bias", seed=4)):
        pool.add(load_encoder(d, tiny_base.space))
    return pool


def _run(base, path, pool, key: str, slots) -> np.ndarray:
    """``key``'s embeddings of TEXTS on the graph at ``path``: base inputs with the encoder's own
    over them, only the inputs the graph takes."""
    session = make_session(path, 1, ["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    feed = {**slots.base_inputs(base), **(adapter_inputs(pool, key, slots) or {})}
    assert set(feed) >= names - {"inputs_embeds", "attention_mask"}
    table = base.model.get_input_embeddings().weight.detach().numpy()
    out = np.empty((len(TEXTS), base.dim), dtype=np.float32)
    for idx, ids, mask in length_buckets(base.tokenizer, TEXTS, base.spec.query_prefix, 64):
        run = {n: t.numpy() for n, t in feed.items() if n in names}
        out[idx] = session.run(None, {"inputs_embeds": np.take(table, ids, axis=0), "attention_mask": mask, **run})[0]
    return out


def test_lora_on_a_subset_of_linears_matches_torch(tiny_base, pool, tmp_path):
    slots = find_slots(tiny_base.layout)
    qv = [m for m, _, _ in slots.linear if m.endswith(QV)]
    export_shared(tiny_base, tmp_path, lora=qv)
    path = tmp_path / SHARED_MODEL_FILE
    sub = slots.only(qv)
    names = {i.name for i in onnx.load(str(path)).graph.input}
    assert {n for n in names if ".lora_" in n} == {f"{m}.lora_{x}" for m in qv for x in "AB"}
    assert all(f"{m}.bias" in names for m, _, _ in slots.linear)   # plain Linears still take their bias
    for key in ("qv@1", "bias@1", BASE_KEY):
        got = _run(tiny_base, path, pool, key, sub)
        assert cosine(got, pool.encode(TEXTS, [key] * len(TEXTS))).min() >= MIN_COSINE, key
    # An encoder with factors on a plain Linear does not fit this graph.
    assert adapter_inputs(pool, "all4@1", sub) is not None and not set(adapter_inputs(pool, "all4@1", sub)) <= names


def test_only_keeps_the_slots_and_marks_the_rest_plain(tiny_base):
    slots = find_slots(tiny_base.layout)
    none = slots.only([])
    assert none.plain == {m for m, _, _ in slots.linear} and not any(".lora_" in n for n in none.input_names())
    assert set(none.base_inputs(tiny_base)) == set(none.input_names())
    assert slots.only(m for m, _, _ in slots.linear) == slots
    assert torch.equal(none.base_inputs(tiny_base)[f"{slots.linear[0][0]}.bias"],
                       tiny_base.model.get_submodule(slots.linear[0][0]).bias)


def test_the_segment_graph_takes_the_same_subset(tiny_base, tmp_path):
    # export_shared checks the graph against torch on probe texts (rank-0 factors) and raises below 0.99999
    slots = find_slots(tiny_base.layout)
    qv = [m for m, _, _ in slots.linear if m.endswith(QV)]
    facts = export_shared(tiny_base, tmp_path, segments=True, lora=qv)
    assert facts["probe_min_cosine"] >= MIN_COSINE
    names = {i.name for i in onnx.load(str(tmp_path / SEGMENTS_MODEL_FILE)).graph.input}
    assert {n for n in names if ".lora_" in n} == {f"{m}.lora_{x}" for m in qv for x in "AB"}

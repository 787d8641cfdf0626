"""``qswap bench forward`` rows for adapters: one query through each runtime with a real adapter.

Arms, side by side in one process, interleaved per round like the rest of ``bench forward``:

- ``ort-merged base``: the base alone, merged export (:class:`qswap.encoders.runtime.onnx.OnnxBackend`);
- ``shared base`` / ``shared lora-rN`` / ``shared bias``: the one shared (fused) session
  (:class:`qswap.encoders.runtime.shared.SharedBackend`) with no adapter, a LoRA of rank N on every
  Linear layer, and a bias encoder (every bias, LayerNorm biases included), float32 factors;
- ``shared lora-rN float16`` / ``bfloat16``: the same LoRA with its factors stored in half
  precision (a pool and a graph per storage type), answers compared with the float32 torch pool;
- ``shared lora-rN ort-adapter``: the same LoRA through ONNX Runtime's own LoRA support (an
  ``AdapterFormat`` file loaded as ``LoraAdapter``, ``RunOptions.add_active_adapter``) on the
  float32 graph, instead of inputs bound once per session (``IOBinding``);
- ``torch base`` / ``torch lora-rN`` / ``torch bias``: the torch pool, the reference.

Memory: bytes each extra LoRA encoder adds (pool + backend) with float32 and with half-precision
factors, and the process RSS after loading ``count`` such encoders (half precision) against one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from qswap.bench.data.encoders import ALL_LINEAR, perturbed_encoder, random_lora_encoder
from qswap.bench.processes import rss_bytes
from qswap.encoders import BASE_KEY, EncoderPool, load_encoder
from qswap.encoders.base import BaseEncoder

TARGETS = list(ALL_LINEAR)   # every Linear of a BERT layer


HALF = ("float16", "bfloat16")


def ort_adapter_arm(shared: Any, key: str, path: Path) -> Callable[[list[str]], np.ndarray]:
    """One query through ONNX Runtime's LoRA adapter support: ``key``'s full feed exported with
    ``AdapterFormat``, loaded as a ``LoraAdapter`` and made active per run.

    The public ``InferenceSession.run`` refuses a feed without the adapter's inputs (its Python
    check runs before the adapter is applied), so the run goes through the session's binding.
    """
    import onnxruntime as ort

    fmt = ort.AdapterFormat()
    fmt.set_parameters(dict(shared._inputs[key].feed))
    fmt.export_adapter(str(path))
    adapter = ort.LoraAdapter()
    adapter.Load(str(path))
    opts = ort.RunOptions()
    opts.add_active_adapter(adapter)
    from qswap.encoders.embedding import length_buckets

    def fn(texts: list[str], keep: Any = adapter) -> np.ndarray:
        # ``keep``: RunOptions holds no reference to the adapter; freed, its parameters vanish.
        (_, ids, mask), = length_buckets(shared.base.tokenizer, texts, shared.base.spec.query_prefix, 64)
        return shared._session._sess.run(["embedding"], shared._inputs_of(ids, mask), opts)[0]
    return fn


def run(base: BaseEncoder, queries: list[str], *, threads: int, rank: int, reps: int, count: int,
        settle: float, spin: bool, merged_base: Callable[[list[str]], np.ndarray] | None,
        timed_arms: Callable[..., Any], spread: Callable[[list[float]], dict[str, float]],
        progress: Callable[[int, str], tuple[Any, Any]]) -> dict[str, Any]:
    """Measure the adapter rows; returns a dict for ``results.json["adapters"]``."""
    from qswap.bench.stats import interleaved, percentile, ratio_summary
    from qswap.encoders.runtime.shared import SharedBackend

    tmp = tempfile.TemporaryDirectory(prefix="qswap-bench-adapters-")
    root = Path(tmp.name)
    lora, bias = "lora@1", "bias@1"
    lora_dir = random_lora_encoder(base, root / "lora", "lora", rank=rank, seed=1)
    pool = EncoderPool(base)
    pool.add(load_encoder(lora_dir, base.space))
    pool.add(load_encoder(perturbed_encoder(base, root / "bias", "bias", seed=2), base.space))
    shared = SharedBackend(pool, root / "cache", threads=threads, spin=spin)
    for k in (BASE_KEY, lora, bias):
        shared.prepare(k)
    pools = {"float32": pool}
    backends = {"float32": shared}
    for dt in HALF:
        pools[dt] = EncoderPool(base, factor_dtype=dt)
        pools[dt].add(load_encoder(lora_dir, base.space))
        backends[dt] = SharedBackend(pools[dt], root / "cache", threads=threads, spin=spin)
        backends[dt].prepare(lora)
    for dt, b in backends.items():
        if not b.wait(lora, timeout=1800):
            raise RuntimeError(f"shared export ({dt} factors) failed: {b.error(lora)}")
    export = json.loads((shared.directory() / "export.json").read_text())
    lname = f"lora-r{rank}"
    fns: dict[str, Callable[[list[str]], np.ndarray]] = {}
    if merged_base is not None:
        fns["ort-merged base"] = merged_base
    fns.update({
        "shared base": lambda t: shared.encode(t, [BASE_KEY] * len(t)),
        f"shared {lname}": lambda t: shared.encode(t, [lora] * len(t)),
        **{f"shared {lname} {dt}": (lambda b: lambda t: b.encode(t, [lora] * len(t)))(backends[dt]) for dt in HALF},
        f"shared {lname} ort-adapter": ort_adapter_arm(shared, lora, root / "lora.onnx_adapter"),
        "shared bias": lambda t: shared.encode(t, [bias] * len(t)),
        "torch base": lambda t: pool.encode(t, [BASE_KEY] * len(t)),
        f"torch {lname}": lambda t: pool.encode(t, [lora] * len(t)),
        "torch bias": lambda t: pool.encode(t, [bias] * len(t)),
    })

    def min_cos(a: np.ndarray, b: np.ndarray) -> float:
        return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())

    cos = {}
    for k in (BASE_KEY, lora, bias):
        cos[k] = min_cos(shared.encode(queries, [k] * len(queries)), pool.encode(queries, [k] * len(queries)))
    ref = pool.encode(queries, [lora] * len(queries)).astype(np.float64)
    shift = ref - pool.encode(queries, [BASE_KEY] * len(queries))   # what the adapter changes
    effect_error: dict[str, float] = {}
    for dt in ("float32", *HALF):   # factors in each storage type against the float32 torch reference
        got = backends[dt].encode(queries, [lora] * len(queries)).astype(np.float64)
        if dt != "float32":
            cos[f"{lora} {dt}"] = min_cos(got, ref)
        # Cosines of whole embeddings saturate near 1: the error relative to the adapter's own
        # shift separates the storage types.
        effect_error[dt] = float((np.linalg.norm(got - ref, axis=1) / np.linalg.norm(shift, axis=1)).max())
    cos[f"{lora} ort-adapter"] = min_cos(np.concatenate([fns[f"shared {lname} ort-adapter"]([q]) for q in queries]), ref)
    bar, tick = progress(reps * len(fns), "adapter rows")
    t = interleaved(timed_arms(fns, [[q] for q in queries], settle), reps, warmup=5, on_round=tick)
    bar.close()

    def ratio(a: str, b: str) -> dict[str, float]:
        rs = ratio_summary(t[a], t[b])
        return {"median": rs.median, "p10": percentile(rs.ratios, 10), "p90": percentile(rs.ratios, 90), "n": rs.n}

    ratios = {f"shared {lname} / shared base": ratio(f"shared {lname}", "shared base"),
              "shared bias / shared base": ratio("shared bias", "shared base"),
              f"shared {lname} / torch {lname}": ratio(f"shared {lname}", f"torch {lname}"),
              "shared base / torch base": ratio("shared base", "torch base"),
              **{f"shared {lname} {dt} / shared {lname}": ratio(f"shared {lname} {dt}", f"shared {lname}")
                 for dt in HALF},
              f"shared {lname} ort-adapter / shared {lname}": ratio(f"shared {lname} ort-adapter", f"shared {lname}")}
    if merged_base is not None:
        ratios["shared base / ort-merged base"] = ratio("shared base", "ort-merged base")
        ratios[f"shared {lname} / ort-merged base"] = ratio(f"shared {lname}", "ort-merged base")
        for dt in HALF:
            ratios[f"shared {lname} {dt} / ort-merged base"] = ratio(f"shared {lname} {dt}", "ort-merged base")

    # Memory: extra LoRA encoders of the same rank (fresh factors each) in the server's default
    # factor type, RSS before and after; the float32 bytes of the same adapter for comparison.
    import gc

    from qswap.factors import SERVING_FACTORS
    factors = SERVING_FACTORS
    mpool, mshared = pools[factors], backends[factors]
    fp32_bytes = pool.memory_bytes(lora)
    gc.collect()
    rss_one = rss_bytes(os.getpid())
    per = []
    for i in range(count):
        key = f"extra{i}@1"
        mpool.add(load_encoder(random_lora_encoder(base, root / f"extra{i}", f"extra{i}", rank=rank, seed=10 + i),
                               base.space))
        mshared.prepare(key)
        per.append(mpool.memory_bytes(key) + mshared.memory_bytes(key))
        mshared.encode(queries[:1], [key])
    gc.collect()
    rss_many = rss_bytes(os.getpid())
    adapter_file = (root / "lora" / "adapter_model.safetensors").stat().st_size
    for b in backends.values():   # closed only now: memory they free would hide the extra encoders' growth
        b.close()
    tmp.cleanup()
    return {"rank": rank, "targets": TARGETS, "single_query_ms": {k: spread([x * 1000 for x in v]) for k, v in t.items()},
            "ratios": ratios, "cosine_shared_vs_torch": cos, "adapter_effect_error": effect_error,
            "shared_export": export,
            "memory": {"extra_encoders": count, "adapter_file_bytes": adapter_file, "factors": factors,
                       "float32_bytes_per_encoder": fp32_bytes,
                       "bytes_per_extra_encoder": int(np.median(per)) if per else 0,
                       "rss_one_encoder_mb": round(rss_one / 2**20, 1),
                       "rss_plus_n_mb": round(rss_many / 2**20, 1),
                       "rss_ratio": round(rss_many / rss_one, 3),
                       "rss_per_extra_encoder_mb": round((rss_many - rss_one) / max(count, 1) / 2**20, 2),
                       "shared_session_weight_mb": round(shared.shared_bytes() / 2**20, 1)}}


def summary_lines(a: dict[str, Any]) -> list[str]:
    from qswap.bench.results import md_table

    lname = f"lora-r{a['rank']}"
    rows = [[k, f"{v['median']:.2f}", f"{v['p10']:.2f}", f"{v['p90']:.2f}", v["n"]]
            for k, v in a["single_query_ms"].items()]
    m = a["memory"]
    g = goals(a)
    return ["## Adapters: one query per runtime (ms)", "",
            f"LoRA of rank {a['rank']} on every Linear layer ({', '.join(a['targets'])}); bias encoder: every "
            "bias, LayerNorm included. `shared` is the default backend: one ONNX Runtime session of the base, the "
            "encoder's tensors bound per run.", "",
            md_table(["arm", "median", "p10", "p90", "n"], rows),
            md_table(["paired ratio", "median", "p10", "p90", "rounds"],
                     [[k, f"{v['median']:.3f}", f"{v['p10']:.3f}", f"{v['p90']:.3f}", v["n"]]
                      for k, v in a["ratios"].items()]),
            f"Min cosine shared vs torch: {', '.join(f'{k} {v:.7f}' for k, v in a['cosine_shared_vs_torch'].items())}.", "",
            "Largest error of the shared runtime's LoRA embedding against torch with float32 factors, relative to the "
            "shift the adapter makes (||shared - torch|| / ||torch - base||), per factor storage type: "
            + ", ".join(f"{k} {v:.2e}" for k, v in a.get("adapter_effect_error", {}).items()) + ".", "",
            f"Memory: each extra {lname} encoder with {m['factors']} factors (the server's default) adds "
            f"{m['bytes_per_extra_encoder'] / 2**20:.2f} MiB (pool + backend; float32 factors: "
            f"{m['float32_bytes_per_encoder'] / 2**20:.2f} MiB; adapter file {m['adapter_file_bytes'] / 2**20:.2f} MiB); "
            f"RSS with 1 encoder + {m['extra_encoders']} more "
            f"{m['rss_plus_n_mb']} MB vs {m['rss_one_encoder_mb']} MB "
            f"({m['rss_ratio']}x, {m['rss_per_extra_encoder_mb']} MB per extra encoder); the shared session's "
            f"weights: {m['shared_session_weight_mb']} MB, once.", "",
            *[f"- {k}: {'yes' if v else '**no**'}" for k, v in g.items()], ""]


def goals(a: dict[str, Any]) -> dict[str, bool]:
    lname, r = f"lora-r{a['rank']}", a["ratios"]
    m = a["memory"]
    fac = f" {m['factors']}" if m["factors"] != "float32" else ""
    out = {}
    if f"shared {lname}{fac} / ort-merged base" in r:
        out[f"shared {lname}{fac} <= 1.05x ort-merged base"] = r[f"shared {lname}{fac} / ort-merged base"]["median"] <= 1.05
    return out | {f"shared {lname} <= 1.15x shared base": r[f"shared {lname} / shared base"]["median"] <= 1.15,
            f"shared {lname} <= 0.35x torch {lname}": r[f"shared {lname} / torch {lname}"]["median"] <= 0.35,
            "shared bias <= 1.05x shared base": r["shared bias / shared base"]["median"] <= 1.05,
            "extra LoRA encoder <= adapter bytes + 1 MiB":
                m["bytes_per_extra_encoder"] <= m["adapter_file_bytes"] + 2**20,
            f"extra LoRA encoder ({m['factors']}) <= half its float32 bytes":
                m["factors"] == "float32" or 2 * m["bytes_per_extra_encoder"] <= m["float32_bytes_per_encoder"],
            "shared cosine to torch >= 0.99999": min(a["cosine_shared_vs_torch"].values()) >= 0.99999}

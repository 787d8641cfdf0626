"""``qswap bench bf16-quality``: what bf16 does to retrieval quality.

Embeds a BEIR corpus twice with the frozen document tower (fp32, then bf16 autocast) and
encodes the queries twice (fp32, then bf16 autocast in batches, as ``qswap serve
--query-precision bf16`` does under load). Three arms are compared with the all-fp32
reference per language: bf16 documents (``qswap index build --precision bf16``), bf16
queries, and both. Reported: cosine of the vectors, nDCG@10, MRR, recall@10/100, and the
pooled two-proportion Z-test on P@1 misses and PND error counts (the same test the tuning
guard uses). bf16 becomes a default only if nothing changes significantly.

``--int8`` adds two query arms in the same run: the merged fp32 ONNX graph of the base
quantised to int8 by ONNX Runtime (``int8``: every weight product, per-channel scales;
``int8-ffn32``: the feed-forward down-projections kept fp32; :mod:`qswap.bench.int8_graphs`),
each against the same all-fp32 reference. ``qswap bench forward`` measures their speed.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from qswap import DEFAULT_MODEL
from qswap.beir import available_languages, load_beir
from qswap.bench.results import ResultWriter, md_table


def register(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("bf16-quality", help="retrieval quality of bf16 vs fp32 document embeddings",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--beir", type=Path, required=True, help="BEIR directory (e.g. from `qswap bench data debian`)")
    p.add_argument("--langs", default=None, help="query languages (default: all in the directory)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--int8", action="store_true",
                   help="also the int8 query arms (ONNX Runtime dynamic quantisation of the merged base graph)")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results/bf16_quality)")
    p.set_defaults(func=main)
    return p


#: arm name -> (query precision, document precision); the reference is fp32/fp32.
ARMS = {"docs bf16": ("fp32", "bf16"), "queries bf16": ("bf16", "fp32"), "both bf16": ("bf16", "bf16")}


#: int8 query arm -> what it quantises (schemes of :data:`qswap.bench.int8_graphs.ARMS`).
INT8_NOTE = {"int8": "every weight product, per-channel scales",
             "int8-ffn32": "the same, feed-forward down-projections kept fp32"}


def _bf16(base: Any, texts: list[str]) -> np.ndarray:
    from qswap.encoders.precision import autocast_context

    with autocast_context(base.device, "bf16"):
        return base.encode_queries(texts)


def _int8_encoders(base: Any, work: Path) -> dict[str, Any]:
    """Query encoders over int8 versions of the base's merged fp32 ONNX export (made in ``work``)."""
    from qswap.bench.int8_graphs import int8_arms
    from qswap.encoders import BASE_KEY, EncoderPool
    from qswap.encoders.runtime.onnx import OnnxBackend

    ort = OnnxBackend(EncoderPool(base), work / "cache")
    ort.prepare(BASE_KEY)
    if not ort.wait(BASE_KEY, timeout=1800):
        raise RuntimeError(f"ONNX export failed: {ort.error(BASE_KEY)}")
    fns, _ = int8_arms(base, ort.directory(BASE_KEY) / "model.onnx", work, ["ort-int8", "ort-int8-ffn32"],
                       threads=os.cpu_count() or 1, spin=True)
    ort.close()
    return {"int8": fns["ort-int8"], "int8-ffn32": fns["ort-int8-ffn32"]}


def main(args: argparse.Namespace) -> int:
    from qswap.encoders import load_base
    from qswap.guard.evaluation import compare_metrics, evaluate_retrieval

    writer = ResultWriter("bf16_quality", args.out)
    base = load_base(args.model)
    arms = dict(ARMS)
    encoders: dict[str, Any] = {"fp32": base.encode_queries, "bf16": lambda t: _bf16(base, t)}
    if args.int8:
        tmp = tempfile.TemporaryDirectory(prefix="qswap-bench-int8-")   # graphs are loaded: gone at exit
        encoders.update(_int8_encoders(base, Path(tmp.name)))
        arms.update({f"queries {k}": (k, "fp32") for k in encoders if k.startswith("int8")})
    langs = args.langs.split(",") if args.langs else available_languages(args.beir) or [None]
    corpus, _, _ = load_beir(args.beir, langs[0])
    ids = list(corpus)
    texts = [corpus[i][0] for i in ids]
    row = {d: n for n, d in enumerate(ids)}
    emb, secs = {}, {}
    base.encode_documents(texts[:64])   # warm-up, so that the first timed arm is not the cold one
    for precision in ("fp32", "bf16"):
        t0 = time.perf_counter()
        emb[precision] = base.encode_documents(texts, progress=True, precision=precision)
        secs[precision] = time.perf_counter() - t0
    cos = np.sum(emb["fp32"] * emb["bf16"], axis=1)
    results: dict[str, Any] = {"documents": len(ids), "seconds": secs,
                               "doc_cosine": {"min": float(cos.min()), "mean": float(cos.mean())},
                               "languages": {}}
    rows = []
    qcos_all: dict[str, list[np.ndarray]] = {k: [] for k in encoders if k != "fp32"}
    for lang in langs:
        _, queries, qrels = load_beir(args.beir, lang)
        qids = list(queries)
        qtexts = [queries[i] for i in qids]
        q = {k: np.concatenate([enc(qtexts[i:i + 32]) for i in range(0, len(qtexts), 32)])
             for k, enc in encoders.items()}
        qcos = {k: np.sum(q["fp32"] * v, axis=1) / np.linalg.norm(v, axis=1) for k, v in q.items() if k != "fp32"}
        for k, c in qcos.items():
            qcos_all[k].append(c)
        relevant = [{row[d]: g for d, g in qrels[i].items()} for i in qids]
        ref = evaluate_retrieval(q["fp32"], emb["fp32"], relevant)
        per_arm = {}
        for arm, (qp, dp) in arms.items():
            cmp = compare_metrics(ref, evaluate_retrieval(q[qp], emb[dp], relevant))
            per_arm[arm] = cmp
            mm, z = cmp["metrics"], cmp["z_tests"]
            rows.append([lang or "-", arm, len(qids), f"{mm['ndcg_at_10']['base']:.4f}",
                         f"{mm['ndcg_at_10']['tuned']:.4f}", f"{mm['mrr']['base']:.4f}", f"{mm['mrr']['tuned']:.4f}",
                         f"{mm['pnd_cos']['base']:.5f}", f"{mm['pnd_cos']['tuned']:.5f}",
                         f"{z['p_at_1_misses']['z']:+.2f} ({z['p_at_1_misses']['change']})",
                         f"{z['pnd_cos']['z']:+.2f} ({z['pnd_cos']['change']})"])
        results["languages"][lang or "-"] = {
            "queries": len(qids), "arms": per_arm,
            "query_cosine": {k: {"min": float(c.min()), "mean": float(c.mean())} for k, c in qcos.items()}}
    qcs = {k: np.concatenate(v) for k, v in qcos_all.items()}
    results["query_cosine"] = {k: {"min": float(c.min()), "mean": float(c.mean())} for k, c in qcs.items()}
    qc = qcs["bf16"]
    md = (f"Corpus: {args.beir} ({len(ids):,} documents), model {args.model}. Documents embedded in fp32 "
          f"({secs['fp32']:.1f} s) and bf16 autocast ({secs['bf16']:.1f} s, "
          f"{secs['fp32'] / secs['bf16']:.2f}x); document cosine bf16 vs fp32: min {cos.min():.6f}, "
          f"mean {cos.mean():.6f}. Queries encoded in fp32 and in bf16 (batches of 32); query cosine: "
          f"min {qc.min():.6f}, mean {qc.mean():.6f}."
          + "".join(f" {k} queries (ONNX Runtime, merged base graph quantised: {INT8_NOTE[k]}): cosine to fp32 "
                    f"min {c.min():.6f}, mean {c.mean():.6f}." for k, c in qcs.items() if k in INT8_NOTE)
          + "\n\n"
          + md_table(["lang", "arm", "queries", "nDCG@10 fp32", "nDCG@10 arm", "MRR fp32", "MRR arm",
                      "PND fp32", "PND arm", "Z P@1 misses", "Z PND errors"], rows)
          + "\n\nEach arm against all-fp32 on the same queries. PND: mean share of (relevant, non-relevant) "
            "pairs ranked the wrong way. Z: pooled two-proportion test, significant at "
            "|Z| > 1.96 (negative = the arm better).\n")
    print(md)
    writer.write(results, md)
    return 0

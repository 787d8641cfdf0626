"""``qswap bench bf16-quality``: what bf16 does to retrieval quality.

Embeds a BEIR corpus twice with the frozen document tower (fp32, then bf16 autocast) and
encodes the queries twice (fp32, then bf16 autocast in batches, as ``qswap serve
--query-precision bf16`` does under load). Three arms are compared with the all-fp32
reference per language: bf16 documents (``qswap index build --precision bf16``), bf16
queries, and both. Reported: cosine of the vectors, nDCG@10, MRR, recall@10/100, and the
pooled two-proportion Z-test on P@1 misses and PND error counts (the same test the tuning
guard uses). bf16 becomes a default only if nothing changes significantly.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results/bf16_quality)")
    p.set_defaults(func=main)
    return p


#: arm name -> (query precision, document precision); the reference is fp32/fp32.
ARMS = {"docs bf16": ("fp32", "bf16"), "queries bf16": ("bf16", "fp32"), "both bf16": ("bf16", "bf16")}


def main(args: argparse.Namespace) -> int:
    from qswap.encoders import load_base
    from qswap.encoders.precision import autocast_context
    from qswap.guard.evaluation import compare_metrics, evaluate_retrieval

    writer = ResultWriter("bf16_quality", args.out)
    base = load_base(args.model)
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
    qcos_all: list[np.ndarray] = []
    for lang in langs:
        _, queries, qrels = load_beir(args.beir, lang)
        qids = list(queries)
        qtexts = [queries[i] for i in qids]
        q = {}
        for precision in ("fp32", "bf16"):
            with autocast_context(base.device, precision):
                q[precision] = base.encode_queries(qtexts)
        qcos = np.sum(q["fp32"] * q["bf16"], axis=1)
        qcos_all.append(qcos)
        relevant = [{row[d]: g for d, g in qrels[i].items()} for i in qids]
        ref = evaluate_retrieval(q["fp32"], emb["fp32"], relevant)
        per_arm = {}
        for arm, (qp, dp) in ARMS.items():
            cmp = compare_metrics(ref, evaluate_retrieval(q[qp], emb[dp], relevant))
            per_arm[arm] = cmp
            mm, z = cmp["metrics"], cmp["z_tests"]
            rows.append([lang or "-", arm, len(qids), f"{mm['ndcg_at_10']['base']:.4f}",
                         f"{mm['ndcg_at_10']['tuned']:.4f}", f"{mm['mrr']['base']:.4f}", f"{mm['mrr']['tuned']:.4f}",
                         f"{z['p_at_1_misses']['z']:+.2f} ({z['p_at_1_misses']['change']})",
                         f"{z['pnd_cos']['z']:+.2f} ({z['pnd_cos']['change']})"])
        results["languages"][lang or "-"] = {"queries": len(qids),
                                             "query_cosine": {"min": float(qcos.min()), "mean": float(qcos.mean())},
                                             "arms": per_arm}
    qc = np.concatenate(qcos_all)
    results["query_cosine"] = {"min": float(qc.min()), "mean": float(qc.mean())}
    md = (f"Corpus: {args.beir} ({len(ids):,} documents), model {args.model}. Documents embedded in fp32 "
          f"({secs['fp32']:.1f} s) and bf16 autocast ({secs['bf16']:.1f} s, "
          f"{secs['fp32'] / secs['bf16']:.2f}x); document cosine bf16 vs fp32: min {cos.min():.6f}, "
          f"mean {cos.mean():.6f}. Queries encoded in fp32 and in bf16 (batches of 32); query cosine: "
          f"min {qc.min():.6f}, mean {qc.mean():.6f}.\n\n"
          + md_table(["lang", "arm", "queries", "nDCG@10 fp32", "nDCG@10 arm", "MRR fp32", "MRR arm",
                      "Z P@1 misses", "Z PND errors"], rows)
          + "\n\nEach arm against all-fp32 on the same queries. Z: pooled two-proportion test, significant at "
            "|Z| > 1.96 (negative = the bf16 arm better).\n")
    print(md)
    writer.write(results, md)
    return 0

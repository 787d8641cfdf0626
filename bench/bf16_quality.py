"""``qswap bench bf16-quality``: what bf16 document embedding does to retrieval quality.

Embeds a BEIR corpus twice with the frozen document tower (fp32, then bf16 autocast), encodes
the queries in fp32 (the serving path), and compares per language: cosine of the document
vectors, nDCG@10, MRR, recall@10/100, and the pooled two-proportion Z-test on P@1 misses and
PND error counts (the same test the tuning guard uses). bf16 becomes a default only if
nothing changes significantly.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from qswap.beir import available_languages, load_beir
from qswap.bench.harness import ResultWriter, md_table


def register(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("bf16-quality", help="retrieval quality of bf16 vs fp32 document embeddings",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--beir", type=Path, required=True, help="BEIR directory (e.g. from `qswap bench data debian`)")
    p.add_argument("--langs", default=None, help="query languages (default: all in the directory)")
    p.add_argument("--model", default="multilingual-e5-small")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results/bf16_quality)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from qswap.encoders import load_base
    from qswap.tuning.evaluation import compare_metrics, evaluate_retrieval

    writer = ResultWriter("bf16_quality", args.out)
    base = load_base(args.model)
    langs = args.langs.split(",") if args.langs else available_languages(args.beir) or [None]
    corpus, _, _ = load_beir(args.beir, langs[0])
    ids = list(corpus)
    texts = [corpus[i][0] for i in ids]
    row = {d: n for n, d in enumerate(ids)}
    emb, secs = {}, {}
    for precision in ("fp32", "bf16"):
        t0 = time.perf_counter()
        emb[precision] = base.encode_documents(texts, progress=True, precision=precision)
        secs[precision] = time.perf_counter() - t0
    cos = np.sum(emb["fp32"] * emb["bf16"], axis=1)
    results: dict[str, Any] = {"documents": len(ids), "seconds": secs,
                               "doc_cosine": {"min": float(cos.min()), "mean": float(cos.mean())},
                               "languages": {}}
    rows = []
    for lang in langs:
        _, queries, qrels = load_beir(args.beir, lang)
        qids = list(queries)
        q = base.encode_queries([queries[i] for i in qids])
        relevant = [{row[d]: g for d, g in qrels[i].items()} for i in qids]
        m = {p: evaluate_retrieval(q, emb[p], relevant) for p in ("fp32", "bf16")}
        cmp = compare_metrics(m["fp32"], m["bf16"])
        results["languages"][lang or "-"] = {"queries": len(qids), **cmp}
        mm, z = cmp["metrics"], cmp["z_tests"]
        rows.append([lang or "-", len(qids), f"{mm['ndcg_at_10']['base']:.4f}", f"{mm['ndcg_at_10']['tuned']:.4f}",
                     f"{mm['mrr']['base']:.4f}", f"{mm['mrr']['tuned']:.4f}",
                     f"{z['p_at_1_misses']['z']:+.2f} ({z['p_at_1_misses']['change']})",
                     f"{z['pnd_cos']['z']:+.2f} ({z['pnd_cos']['change']})"])
    md = (f"Corpus: {args.beir} ({len(ids):,} documents), model {args.model}. Documents embedded in fp32 "
          f"({secs['fp32']:.1f} s) and bf16 autocast ({secs['bf16']:.1f} s, "
          f"{secs['fp32'] / secs['bf16']:.2f}x); queries in fp32. Document cosine bf16 vs fp32: "
          f"min {cos.min():.6f}, mean {cos.mean():.6f}.\n\n"
          + md_table(["lang", "queries", "nDCG@10 fp32", "nDCG@10 bf16", "MRR fp32", "MRR bf16",
                      "Z P@1 misses", "Z PND errors"], rows)
          + "\n\nZ: pooled two-proportion test, significant at |Z| > 1.96 (negative = bf16 better).\n")
    print(md)
    writer.write(results, md)
    return 0

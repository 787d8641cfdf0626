"""``qswap bench quality``: base vs tuned query encoder on a BEIR set, per language and dimension.

Documents come from ``--index`` (its stored vectors) when given, else from the document cache
`qswap tune` fills (fp16, the vectors `tune run` and `tune eval` score against), embedded only
if missing; queries by the base and by the tuned encoder
(through :class:`~qswap.encoders.EncoderPool`, the serving path). Every query the tuning saw
(train and validation split, rebuilt from ``--seed`` / ``--val-size`` / ``--test-size`` exactly as
``qswap tune run`` made them) is excluded in every language, since ids are shared across
languages. At each Matryoshka dimension both sides are truncated and renormalised. Reports
nDCG@10 and recall@100 with the improvement I, and pooled two-proportion Z-tests on P@1 misses
and recall@100 misses (significant at |Z| > 1.96).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


from qswap.bench.results import ResultWriter, md_table


def register(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("quality", help="base vs tuned encoder: nDCG@10 / recall@100 per language and dim",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--beir", type=Path, required=True)
    p.add_argument("--encoder", type=Path, required=True, help="tuned encoder directory")
    p.add_argument("--train-lang", default="en")
    p.add_argument("--langs", default="en,de,fr,it")
    p.add_argument("--dims", default="384,256,128")
    p.add_argument("--val-size", type=float, default=0.1, help="as given to `qswap tune run`")
    p.add_argument("--test-size", type=float, default=0.1, help="as given to `qswap tune run`")
    p.add_argument("--seed", type=int, default=0, help="as given to `qswap tune run`")
    p.add_argument("--cache-dir", type=Path, help="document-embedding cache, as `qswap tune` uses "
                                                 "(default <data dir>/doc-cache)")
    p.add_argument("--index", type=Path, help="a qswap index of the base's space: documents it holds take its "
                                              "stored vectors (no re-embedding)")
    p.add_argument("--out", type=Path, default=None)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from qswap.beir import load_beir
    from qswap.encoders import load_query_encoder, truncate
    from qswap.tuning.data import read_beir, split_samples
    from qswap.tuning.doc_cache import StoredEmbeddings, embed_documents
    from qswap.tuning.progress import encode_with_progress
    from qswap.guard.evaluation import evaluate_retrieval
    from qswap.guard.stats import compare_counts, improvement

    writer = ResultWriter("quality", args.out)
    loaded = load_query_encoder(args.encoder)
    base = loaded.base
    seen_split = split_samples(read_beir(args.beir, args.train_lang).samples(), args.val_size, args.test_size, args.seed)
    seen = {s.qid for s in seen_split.train + seen_split.validation}
    corpus, _, _ = load_beir(args.beir, args.train_lang)
    ids = list(corpus)
    row = {d: i for i, d in enumerate(ids)}
    # The same document vectors `qswap tune run` / `tune eval` score against (the fp16 cache,
    # filled once): one evaluation path, and no second 10-minute embedding of the corpus.
    stored = None
    if args.index is not None:
        from qswap.index import open_index
        with open_index(args.index, read_only=True) as idx:
            stored = StoredEmbeddings.from_index(idx)
    docs = embed_documents(base, [corpus[d][0] for d in ids], args.cache_dir, progress=True, ids=ids, stored=stored)
    dims = [int(d) for d in args.dims.split(",")]
    results: dict[str, Any] = {"encoder": loaded.key, "excluded_seen_queries": len(seen), "documents": len(ids),
                               "rows": []}
    table = []
    for lang in args.langs.split(","):
        _, queries, qrels = load_beir(args.beir, lang)
        qids = [q for q in queries if q not in seen]
        texts = [queries[q] for q in qids]
        relevant = [{row[d]: g for d, g in qrels[q].items()} for q in qids]
        q_base = encode_with_progress(loaded.encode_base, texts, f"{lang} queries (base)")
        q_tuned = encode_with_progress(loaded.encode, texts, f"{lang} queries (tuned)")
        for dim in dims:
            d = truncate(docs, dim)
            mb = evaluate_retrieval(truncate(q_base, dim), d, relevant, ks=(10, 100))
            mt = evaluate_retrieval(truncate(q_tuned, dim), d, relevant, ks=(10, 100))
            n = len(qids)
            p1 = compare_counts(n - mb.hits_at_1, n - mt.hits_at_1, n)
            r100 = compare_counts(round(n * (1 - mb.recall[100])), round(n * (1 - mt.recall[100])), n)
            rec = {"lang": lang, "dim": dim, "queries": n,
                   "ndcg_at_10": [mb.ndcg_at_10, mt.ndcg_at_10, improvement(mb.ndcg_at_10, mt.ndcg_at_10, False)],
                   "recall_at_100": [mb.recall[100], mt.recall[100],
                                     improvement(mb.recall[100], mt.recall[100], False)],
                   "z_p_at_1_misses": p1.to_dict(), "z_recall_at_100_misses": r100.to_dict()}
            results["rows"].append(rec)
            table.append([lang, dim, n, f"{mb.ndcg_at_10:.4f} → {mt.ndcg_at_10:.4f}", f"{rec['ndcg_at_10'][2]:+.1%}",
                          f"{p1.z:+.2f} {p1.change}", f"{mb.recall[100]:.4f} → {mt.recall[100]:.4f}",
                          f"{r100.z:+.2f} {r100.change}"])
    md = (f"Encoder {loaded.key} ({args.encoder}) vs its base on {args.beir} ({len(ids):,} documents). "
          f"{len(seen)} queries the tuning saw (train + validation) excluded in every language.\n\n"
          + md_table(["lang", "dim", "queries", "nDCG@10 base → tuned", "I", "Z P@1 misses",
                      "recall@100 base → tuned", "Z recall@100 misses"], table)
          + "\n\nZ: pooled two-proportion test over queries, significant at |Z| > 1.96 (negative = tuned better).\n")
    print(md)
    writer.write(results, md)
    return 0

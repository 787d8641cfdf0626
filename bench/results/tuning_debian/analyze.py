"""Re-evaluate a `qswap tune run` encoder on the Debian BEIR test split, per language.

Adds what the run's report.md leaves out: recall@k for every language, and per-query
*paired* tests next to the report's pooled PND Z-test (which treats the ~1M
(relevant, non-relevant) pairs of 500 queries as independent, so it overstates
significance). Per query: the PND error count and the reciprocal rank, base vs tuned;
a paired t on the per-query error differences (query-clustered), a sign test on
reciprocal-rank wins/losses, and a paired bootstrap 95% interval for the MRR change.

Usage (same data, seed and split sizes as the run):
    .venv/bin/python bench/results/tuning_debian/analyze.py RUN_DIR --beir /tmp/deb2k \
        --val-size 400 --test-size 500 --seed 0 --langs en,de,fr,it --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from qswap.beir import read_corpus, read_qrels, read_queries
from qswap.encoders import EncoderPool, load_base, load_encoder
from qswap.tuning.data import read_beir, split_samples
from qswap.tuning.doc_cache import embed_documents
from qswap.guard.evaluation import evaluate_retrieval
from qswap.guard.stats import compare_counts, improvement

KS = (1, 5, 10, 100)


def per_query(q: np.ndarray, docs: np.ndarray, rel_rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(PND errors, reciprocal rank) of each query; ties count as errors, as in qswap.guard.evaluation."""
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    dn = docs / np.linalg.norm(docs, axis=1, keepdims=True)
    sims = qn.astype(np.float64) @ dn.astype(np.float64).T
    errs, rr = np.zeros(len(q)), np.zeros(len(q))
    for i, rows in enumerate(rel_rows):
        s = sims[i]
        mask = np.zeros(len(s), bool)
        mask[rows] = True
        neg = s[~mask]
        errs[i] = sum(int((neg >= s[r]).sum()) for r in rows)
        best = max(s[r] for r in rows)
        rr[i] = 1.0 / (1 + int((neg >= best).sum()))
    return errs, rr


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact binomial p-value of wins vs losses (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    p = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--beir", type=Path, required=True)
    ap.add_argument("--lang", default="en")
    ap.add_argument("--langs", default="en,de,fr,it")
    ap.add_argument("--val-size", type=float, default=400)
    ap.add_argument("--test-size", type=float, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    base = load_base("multilingual-e5-small", device="cpu")
    art = load_encoder(args.run, expected_space=base.space)
    pool = EncoderPool(base)
    pool.add(art)
    # Same split as run_tuning: no --max-samples, split_samples(samples, val, test, seed).
    samples = read_beir(args.beir, args.lang).samples()
    test_qids = {s.qid for s in split_samples(samples, args.val_size, args.test_size, args.seed).test}
    corpus = read_corpus(args.beir)
    ids, texts = list(corpus), [doc.text for doc in corpus.values()]
    docs = embed_documents(base, texts, None, progress=False, ids=list(ids))
    row = {d: i for i, d in enumerate(ids)}
    rng = np.random.default_rng(0)
    out = {}
    for lang in args.langs.split(","):
        queries, qrels = read_queries(args.beir, lang), read_qrels(args.beir, lang)
        qids = [q for q in queries if q in test_qids and any(g > 0 and d in row for d, g in qrels.get(q, {}).items())]
        rel = [{row[d]: g for d, g in qrels[q].items() if g > 0 and d in row} for q in qids]
        qtexts = [queries[q] for q in qids]
        qb = base.encode_queries(qtexts)
        qt = pool.encode(qtexts, [art.key] * len(qtexts))
        mb, mt = evaluate_retrieval(qb, docs, rel, KS), evaluate_retrieval(qt, docs, rel, KS)
        eb, rb = per_query(qb, docs, [list(r) for r in rel])
        et, rt = per_query(qt, docs, [list(r) for r in rel])
        assert int(eb.sum()) == mb.errors_cos and int(et.sum()) == mt.errors_cos
        assert abs(rb.mean() - mb.mrr) < 1e-9 and abs(rt.mean() - mt.mrr) < 1e-9
        d = et - eb
        t_paired = float(d.mean() / (d.std(ddof=1) / math.sqrt(len(d)))) if d.std() > 0 else 0.0
        wins, losses = int((rt > rb).sum()), int((rt < rb).sum())
        idx = rng.integers(0, len(rr := rt - rb), size=(2000, len(rr)))
        boot = rr[idx].mean(axis=1)
        pooled = compare_counts(mb.errors_cos, mt.errors_cos, mb.pairs).to_dict()
        cell = {
            "queries": len(qids), "pairs": mb.pairs,
            "pnd_errors": {"base": mb.errors_cos, "tuned": mt.errors_cos,
                           "I": improvement(mb.errors_cos, mt.errors_cos, True), "z_pooled": pooled["z"],
                           "significant_pooled": pooled["significant"], "t_paired_per_query": t_paired,
                           "queries_fewer_errors": int((d < 0).sum()), "queries_more_errors": int((d > 0).sum())},
            "mrr": {"base": mb.mrr, "tuned": mt.mrr, "I": improvement(mb.mrr, mt.mrr, False),
                    "rr_wins": wins, "rr_losses": losses, "sign_test_p": sign_test(wins, losses),
                    "delta_ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]},
            "ndcg_at_10": {"base": mb.ndcg_at_10, "tuned": mt.ndcg_at_10,
                           "I": improvement(mb.ndcg_at_10, mt.ndcg_at_10, False)},
            "recall": {str(k): {"base": mb.recall[k], "tuned": mt.recall[k],
                                "I": improvement(mb.recall[k], mt.recall[k], False)} for k in KS},
        }
        out[lang] = cell
        print(f"{lang}: n={len(qids)} PND err {mb.errors_cos}->{mt.errors_cos} (I {100 * cell['pnd_errors']['I']:+.1f}%, "
              f"Z {pooled['z']:+.2f}, paired t {t_paired:+.2f}); MRR {mb.mrr:.4f}->{mt.mrr:.4f} "
              f"(wins/losses {wins}/{losses}, p {cell['mrr']['sign_test_p']:.3g}, CI {cell['mrr']['delta_ci95']}); "
              f"nDCG@10 {mb.ndcg_at_10:.4f}->{mt.ndcg_at_10:.4f}; "
              + " ".join(f"R@{k} {mb.recall[k]:.3f}->{mt.recall[k]:.3f}" for k in KS), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""``qswap bench guard``: what the server's guard costs, and how often each test is wrong.

Two parts, side by side in one run:

- **budget**: a real ``qswap serve --sentinels`` (child process) over the given index; one
  encoder is registered (202, background evaluation) while a client keeps searching; reports
  the evaluation's wall time (and its query-encoding share), the warm-up at start (base
  queries), and search latency while idle vs while the evaluation runs.
- **false alarms and power**: per-query nDCG@10 / PND errors of the base and of encoders that
  truly differ (every bias perturbed by Gaussian noise of a given scale), on the same
  sentinels and index, in-process (the server's scoring: ``evaluate_retrieval`` on the
  index's stored vectors). Resampled query subsets (``--subset`` of each sentinel, ``--rounds``
  times) are judged by the guard's decision (Wilcoxon signed-rank on nDCG@10, Holm over the
  sentinels, regression = adjusted p < 0.05 and the mean fell) and by the old pooled PND
  Z-test (any sentinel Z > 1.96). Nulls, where no encoder is worse: (a) the base against
  itself with its query vectors rounded to fp16 (a change that does not matter), (b) every
  pair of encoders with each query's before/after swapped at random (no difference by
  construction, but the real within-query correlation of the PND pairs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from qswap.bench.results import ResultWriter, md_table
from qswap.bench.processes import ServerProcess, free_port, http_json
from qswap.bench.data.encoders import perturbed_encoder
from qswap.bench.plots import plot_bars
from qswap.bench.stats import percentile

_TESTS = (("guard_wilcoxon_holm", "guard: Wilcoxon + Holm"), ("sign_bonferroni", "sign test"),
          ("paired_t_bonferroni", "paired t"), ("pooled_z", "pooled PND Z (old guard)"))


def plot_alarms(path: Path, alarms: dict[str, Any]) -> Path:
    """Refusal rate per scenario and test (nulls should stay under the 5 % line)."""
    sc = alarms["scenarios"]
    labels = [x["scenario"].replace("pairs swapped at random", "swapped").replace("base vs ", "") for x in sc]
    return plot_bars(path, labels, {name: [100 * x["refusal_rate"][t] for x in sc] for t, name in _TESTS},
                     ylabel="% of rounds refused", title=f"guard refusals, {alarms['rounds']} rounds of "
                                                         f"{alarms['subset']} queries per sentinel")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--index", type=Path, required=True, help="the served index (e.g. 10,000 Debian documents)")
    p.add_argument("--sentinels", type=Path, required=True, help="sentinels over it (`qswap sentinels make`)")
    p.add_argument("--model", default="multilingual-e5-small")
    p.add_argument("--scales", default="0.002,0.01,0.03", help="bias noise of the encoders that truly differ")
    p.add_argument("--subset", type=int, default=500, help="queries drawn from each sentinel per round")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--parts", default="budget,alarms")
    p.add_argument("--traffic", action=argparse.BooleanOptionalAction, default=True,
                   help="budget: keep a search client running during the registration (its latency is "
                        "reported); --no-traffic measures the evaluation on an otherwise idle server")
    p.add_argument("--seed", type=int, default=0)


# --------------------------------------------------------------------------- budget


def _budget(args: argparse.Namespace, base: Any, work: Path, quick: bool) -> dict[str, Any]:
    root = work / "encroot"
    perturbed_encoder(base, root / "probe", "probe", scale=0.01, seed=args.seed)
    port = free_port()
    log = work / "server.log"
    cmd = [sys.executable, "-m", "qswap.cli", "serve", "--index", str(args.index), "--sentinels", str(args.sentinels),
           "--encoders-root", str(root), "--insecure", "--port", str(port), "--state-dir", str(work / "state"),
           "--model", args.model]
    out: dict[str, Any] = {"command": " ".join(cmd)}
    with ServerProcess(cmd, port, ready_path="/readyz", log_path=log) as srv:
        t0 = time.perf_counter()
        while "guard warmed up" not in log.read_text(errors="replace"):
            if time.perf_counter() - t0 > 900:
                raise RuntimeError("guard warm-up did not finish in 15 min:\n" + srv.log_tail())
            time.sleep(0.5)
        warm = [json.loads(ln) for ln in log.read_text().splitlines() if "guard warmed up" in ln]
        out["warm_up_seconds"] = warm[-1].get("seconds") if warm else None
        lat: dict[str, list[float]] = {"idle": [], "evaluating": []}
        phase = {"name": "idle", "stop": False}

        def client() -> None:
            i = 0
            while not phase["stop"]:
                t = time.perf_counter()
                status, _ = http_json("POST", srv.url("/v1/search"), {"query": f"text editor {i}", "k": 10})
                if status == 200:
                    lat[phase["name"]].append((time.perf_counter() - t) * 1000)
                i += 1

        th = threading.Thread(target=client, daemon=True)
        if args.traffic:
            th.start()
            time.sleep(3 if quick else 10)
        phase["name"] = "evaluating"
        t_reg = time.perf_counter()
        status, body = http_json("POST", srv.url("/v1/encoders"), {"path": "probe"})
        out["register_status"] = status
        out["register_answer_seconds"] = round(time.perf_counter() - t_reg, 3)
        while True:
            _, info = http_json("GET", srv.url("/v1/encoders/probe@1"))
            if info.get("guard_status") != "evaluating":
                break
            time.sleep(0.25)
        out["verdict_seconds_wall"] = round(time.perf_counter() - t_reg, 2)
        phase["stop"] = True
        if args.traffic:
            th.join(30)
        out["traffic"] = args.traffic
        ev = info.get("evaluation") or {}
        out.update({"guard_status": info.get("guard_status"), "evaluation_seconds": ev.get("seconds"),
                    "encode_seconds": ev.get("encode_seconds"), "index_documents": ev.get("index_documents"),
                    "checks": ev.get("checks"),
                    "progress_lines": sum("guard evaluation progress" in ln for ln in log.read_text().splitlines())})
        for k, v in lat.items():
            out[f"search_ms_{k}"] = {"n": len(v), "p50": percentile(v, 50) if v else None,
                                     "p95": percentile(v, 95) if v else None}
    return out


# --------------------------------------------------------------------------- false alarms


def _per_query(q: np.ndarray, docs: np.ndarray, rel: list[dict[int, int]]) -> dict[str, np.ndarray]:
    from qswap.guard.evaluation import evaluate_retrieval
    m = evaluate_retrieval(q, docs, rel, ks=(10,))
    return {k: np.asarray(v, dtype=np.float64) for k, v in m.per_query.items()}


def _decide(before: list[dict[str, np.ndarray]], after: list[dict[str, np.ndarray]],
            subsets: list[np.ndarray], swaps: list[np.ndarray | None]) -> dict[str, bool]:
    """One round: the guard's paired decision and the pooled-Z decision over all sentinels."""
    from qswap.guard.stats import holm, paired_compare, z_test
    ps, deltas, sign_bad, z_bad, t_bad = [], [], False, False, False
    for b, a, idx, sw in zip(before, after, subsets, swaps):
        bb = {k: v[idx] for k, v in b.items()}
        aa = {k: v[idx] for k, v in a.items()}
        if sw is not None:
            for k in bb:
                bb[k], aa[k] = np.where(sw, aa[k], bb[k]), np.where(sw, bb[k], aa[k])
        c = paired_compare(bb["ndcg_at_10"], aa["ndcg_at_10"])
        ps.append(c.p_value)
        deltas.append(c.delta)
        sign_bad |= c.sign_p_value < 0.05 / len(before) and c.losses > c.wins
        t_bad |= c.t_p_value < 0.05 / len(before) and c.delta < 0
        pairs = int(bb["pnd_pairs"].sum())
        z_bad |= z_test(int(bb["pnd_errors"].sum()), int(aa["pnd_errors"].sum()), pairs) > 1.96
    guard_bad = any(p < 0.05 and d < 0 for p, d in zip(holm(ps), deltas))
    return {"guard_wilcoxon_holm": guard_bad, "sign_bonferroni": sign_bad, "paired_t_bonferroni": t_bad,
            "pooled_z": z_bad}


def _alarms(args: argparse.Namespace, base: Any, work: Path, quick: bool) -> dict[str, Any]:
    from qswap.encoders import BASE_KEY, EncoderPool, load_encoder
    from qswap.index import open_index
    from qswap.guard.sentinels import load_sentinels

    sentinels = load_sentinels(args.sentinels)
    with open_index(args.index, read_only=True) as idx:
        ids, vectors = idx.export_embeddings()
    rows = {d: i for i, d in enumerate(ids)}
    docs = np.asarray(vectors, dtype=np.float32)
    pool = EncoderPool(base)
    scales = [float(x) for x in args.scales.split(",") if x.strip()]
    keys = {}
    for i, sc in enumerate(scales):
        art = load_encoder(perturbed_encoder(base, work / f"noise{i}", f"noise{i}", scale=sc, seed=args.seed + i),
                           base.space)
        pool.add(art)
        keys[f"bias noise {sc:g}"] = art.key
    t0 = time.perf_counter()
    per: dict[str, list[dict[str, np.ndarray]]] = {"base": [], "base fp16": [], **{k: [] for k in keys}}
    for s in sentinels:
        rel = [{rows[d]: g for d, g in r.items() if d in rows} for r in s.qrels]
        q = pool.encode(s.texts, [BASE_KEY] * len(s.texts))
        per["base"].append(_per_query(q, docs, rel))
        per["base fp16"].append(_per_query(q.astype(np.float16).astype(np.float32), docs, rel))
        for label, key in keys.items():
            per[label].append(_per_query(pool.encode(s.texts, [key] * len(s.texts)), docs, rel))
    encode_s = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed)
    rounds = max(20, args.rounds // 5) if quick else args.rounds
    n_q = [len(s.qids) for s in sentinels]
    m = min(args.subset, *n_q)
    scenarios = [("null: base vs base fp16 queries", "base", "base fp16", False)]
    scenarios += [(f"null: base vs {k}, pairs swapped at random", "base", k, True) for k in keys]
    scenarios += [(f"real: base vs {k}", "base", k, False) for k in keys]
    table, out = [], {"sentinels": [{"name": s.name, "queries": len(s.qids)} for s in sentinels],
                      "subset": m, "rounds": rounds, "encode_seconds": round(encode_s, 1), "scenarios": []}
    for label, b, a, swap in scenarios:
        counts: dict[str, int] = {}
        for _ in range(rounds):
            subsets = [np.sort(rng.choice(n, m, replace=False)) for n in n_q]
            swaps = [rng.random(m) < 0.5 if swap else None for _ in n_q]
            for test, bad in _decide(per[b], per[a], subsets, swaps).items():
                counts[test] = counts.get(test, 0) + int(bad)
        full = [{"sentinel": s.name, "ndcg_before": float(per[b][i]["ndcg_at_10"].mean()),
                 "ndcg_after": float(per[a][i]["ndcg_at_10"].mean())} for i, s in enumerate(sentinels)]
        rates = {t: c / rounds for t, c in counts.items()}
        out["scenarios"].append({"scenario": label, "refusal_rate": rates, "full_sets": full})
        delta = np.mean([f["ndcg_after"] - f["ndcg_before"] for f in full])
        table.append([label, f"{delta:+.4f}", *(f"{rates[t]:.1%}" for t in
                                               ("guard_wilcoxon_holm", "sign_bonferroni", "paired_t_bonferroni",
                                                "pooled_z"))])
    out["markdown"] = (
        f"## False alarms and power\n\n{len(sentinels)} sentinels ({', '.join(f'{s.name} {n}' for s, n in zip(sentinels, n_q))} "
        f"queries) over {len(ids):,} documents; each round draws {m} queries of every sentinel; {rounds} rounds. "
        "Cells: share of rounds in which the encoder is refused (some sentinel significantly worse). "
        "Nulls should sit at or below 5 %; real differences show the power.\n\n"
        + md_table(["scenario", "mean Δ nDCG@10 (full sets)", "guard: Wilcoxon + Holm", "sign test (Bonferroni)",
                    "paired t (Bonferroni)", "pooled PND Z > 1.96 (old guard)"], table))
    return out


def run(args: argparse.Namespace) -> int:
    from qswap.encoders import load_base

    name = "guard"
    out_dir = args.out or (Path("bench/results/guard/tmp/quick") if args.quick else None)
    writer = ResultWriter(name, out_dir)
    base = load_base(args.model)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    results: dict[str, Any] = {"parts": parts}
    work = Path(tempfile.mkdtemp(prefix="qswap-bench-guard-"))
    md = []
    try:
        if "budget" in parts:
            b = results["budget"] = _budget(args, base, work, args.quick)
            md.append("## Budget: one registration on a running server\n\n" + md_table(
                ["sentinel queries", "documents", "warm-up at start (s)", "202 after (s)",
                 "verdict after (s)", "of which encoding (s)", "progress lines", "search p50 idle → evaluating (ms)"],
                [[sum(c["n"] for c in b["checks"] if c["against"] == "base"), b["index_documents"],
                  b["warm_up_seconds"], b["register_answer_seconds"], b["verdict_seconds_wall"], b["encode_seconds"],
                  b["progress_lines"],
                  f"{b['search_ms_idle']['p50']:.1f} → {b['search_ms_evaluating']['p50']:.1f} "
                  f"({b['search_ms_idle']['n']} / {b['search_ms_evaluating']['n']} requests)"
                  if b["traffic"] else "no search traffic (--no-traffic)"]]))
            # Written at once: the second part takes minutes more on a busy machine.
            writer.write(results, "\n\n".join(md))
        if "alarms" in parts:
            a = _alarms(args, base, work, args.quick)
            md.append(a.pop("markdown"))
            results["alarms"] = a
            plot_alarms(writer.plot_path("refusals.png"), a)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    writer.write(results, "\n\n".join(md))
    print("\n\n".join(md))
    return 0

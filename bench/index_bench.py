"""Index benchmark: recall@10, bytes per document, latency and build time per index option.

For each (dim, quant, kind, rescore) of :class:`qswap.index.IndexConfig` (plus the search
beam of HNSW and the lists visited by IVF), over one stored set of vectors:

- recall@10 against exact search over the original float32 full-dimension vectors
  (:func:`qswap.bench.data.exact_ground_truth`; stricter than qswap's own evaluation,
  which compares against its stored float16 copy);
- bytes per document of the FAISS structure, and of what search touches in memory
  (FAISS + the float16 full-dimension rows read when rescoring);
- p50/p99 latency of ``DocumentIndex.search`` for one query (as the server calls it:
  FAISS, rescoring, document-store lookup), after a warm-up;
- build time of the FAISS structure from the stored vectors (``DocumentIndex.with_config``).

Data: synthetic clustered unit vectors (:func:`qswap.bench.data.clustered_embeddings`) with
held-out queries from the same clusters; and, when given with ``--real``, real embeddings
(an ``.npy`` of document vectors whose last ``--real-queries`` rows become the queries).
The plot is the recall-vs-latency Pareto front: the operating points idea of FAISS's
``contrib`` module (keep a setting only if no faster one is as accurate).
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qswap import DEFAULT_MODEL
from qswap.bench.index_backends import (add_backend_arguments, real_debian_embeddings, recall_and_latency,
                                       run_backends)
from qswap.bench.results import ResultWriter, md_table, results_dir_for
from qswap.bench.plots import pareto_front, plot_lines, plot_pareto
from qswap.bench.stats import summarize
from qswap.errors import InvalidInputError

NAME = "index"
K = 10
#: What ``--backend`` may list: FAISS, milvus-lite (embedded) and a Milvus server (a LocalMilvus per run).
BACKENDS = ("faiss", "milvus", "milvus-server")


@dataclass(frozen=True)
class Setting:
    """One point of the grid: build shape (dim, quant, kind) and search-time options."""

    dim: int
    quant: str
    kind: str
    rescore: bool
    nprobe: int | None = None
    ef_search: int | None = None

    @property
    def shape(self) -> tuple[int, str, str]:
        return (self.dim, self.quant, self.kind)

    @property
    def label(self) -> str:
        extra = f" nprobe={self.nprobe}" if self.nprobe else f" ef={self.ef_search}" if self.ef_search else ""
        return f"{self.kind} {self.quant} d{self.dim}{extra}{' +rescore' if self.rescore else ''}"


def grid(quick: bool, full_dim: int = 384) -> list[Setting]:
    """The settings measured, most telling first (a run out of time budget drops the tail):
    the exact reference and qswap's defaults (HNSW+SQ8 up to 1M documents, IVF+SQ8 beyond),
    other quantisations at full dimension, Matryoshka prefixes, then product quantisation
    (whose codebook training takes about a minute per shape on two cores)."""
    d_full, d_mid, d_low, d_min = full_dim, full_dim * 2 // 3, full_dim // 3, full_dim // 6
    out: list[Setting] = [Setting(d_full, "fp32", "flat", False)]

    def both(d: int, q: str, kind: str, **kw: int) -> None:
        out.extend(Setting(d, q, kind, r, **kw) for r in (False, True))

    for ef in ((16, 64) if quick else (16, 64, 256)):
        both(d_full, "sq8", "hnsw", ef_search=ef)
    for nprobe in ((4, 16) if quick else (4, 16, 64)):
        both(d_full, "sq8", "ivf", nprobe=nprobe)
    for q in ("fp16", "sq8", "sq4"):
        both(d_full, q, "flat")
    for d in ((d_mid, d_min) if quick else (d_mid, d_low, d_min)):
        for q in ("fp32", "sq8", "sq4"):
            both(d, q, "flat")
    if not quick:
        for ef in (16, 64, 256):
            both(d_low, "sq8", "hnsw", ef_search=ef)
        for nprobe in (4, 16, 64):
            both(d_low, "sq8", "ivf", nprobe=nprobe)
    if not quick:   # PQ codebooks take a minute to train here: not in a smoke run
        both(d_full, "pq", "flat")
        both(d_low, "pq", "flat")
    return [s for s in out if s.dim >= 8]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench index``."""
    p.add_argument("--n", type=int, default=None, help="synthetic documents (default 200,000; quick 5,000)")
    p.add_argument("--queries", type=int, default=None, help="recall queries (default 1000; quick 100)")
    p.add_argument("--latency-queries", type=int, default=None, help="single-query timings (default 200; quick 30)")
    p.add_argument("--dim", type=int, default=384, help="full embedding dimension of the synthetic set")
    p.add_argument("--clusters", type=int, default=None, help="synthetic clusters (default 1024; quick 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--real", type=Path, default=None, metavar="NPY",
                   help="also measure real embeddings: (n, dim) float32 .npy; its last --real-queries rows are queries")
    p.add_argument("--real-queries", type=int, default=500)
    p.add_argument("--real-debian", type=int, default=None, metavar="N",
                   help="also measure real embeddings: N Debian one-line descriptions embedded by --model "
                        "(cached; default 30000 in full mode, 0 = skip; quick 0)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model of --real-debian")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop building new index shapes after this many seconds (default 360 for the "
                        "synthetic set, 40 %% of it for the real one; the rest is listed as skipped)")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default <out>/tmp/work)")
    p.add_argument("--backend", default="faiss", metavar="LIST",
                   help="faiss (default): the FAISS option grid; a list of faiss, milvus (milvus-lite) and "
                        "milvus-server (a Milvus server started for the run), e.g. faiss,milvus-server: the "
                        "backends side by side on the same vectors, queries and options (results in "
                        "<out>/backends/)")
    add_backend_arguments(p)


def _measure(idx: Any, s: Setting, queries: Any, truth: Any, n_latency: int) -> dict[str, Any]:
    """Recall, latency and bytes of one search-time variant of ``idx`` (already built)."""
    recall, lat = recall_and_latency(idx, queries, truth, n_latency, batch=256)
    info = idx.info()
    faiss_b = float(info["bytes_per_doc"]["faiss"])
    # Rescoring reads the float16 full-dimension rows of the candidates: they must be in memory.
    touched = faiss_b + (info["full_dim"] * 2 if info["rescoring"] else 0)
    return {"setting": s.label, "dim": s.dim, "quant": s.quant, "kind": s.kind, "rescore": s.rescore,
            "rescoring_active": bool(info["rescoring"]), "nprobe": s.nprobe, "ef_search": s.ef_search,
            "factory": info["faiss"]["factory"], f"recall@{K}": recall,
            "bytes_per_doc_faiss": faiss_b, "bytes_per_doc_search": float(touched),
            "latency_ms": summarize(lat), "oversample": info["config"]["oversample"]}


def run_set(name: str, base: Any, queries: Any, work: Path, settings: list[Setting], n_latency: int,
            progress: bool = True, budget_s: float = float("inf")) -> dict[str, Any]:
    """Build one stored index of ``base`` and measure every setting on it (new shapes only
    while less than ``budget_s`` has passed; the others are returned as ``skipped``)."""
    import numpy as np
    from tqdm import tqdm

    from qswap.bench.data.synthetic import exact_ground_truth
    from qswap.index import Document, IndexConfig, create_index
    from qswap.space import EmbeddingSpace

    n, dim = base.shape
    t0 = time.perf_counter()
    _, truth = exact_ground_truth(base, queries, K)
    t_gt = time.perf_counter() - t0
    # The vectors are not from a model: a space of their own keeps them apart from real ones.
    space = EmbeddingSpace(name=f"bench-{name}", weights_sha256="0" * 64, tokenizer_sha256="0" * 64,
                           pooling="mean", query_prefix="", document_prefix="", normalize=True, dim=dim)
    path = work / f"{name}-index"
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    docs = [Document(str(i), f"doc {i}") for i in range(n)]
    store = create_index(path, docs, np.asarray(base, dtype=np.float32), space,
                         IndexConfig(kind="flat", quant="fp32", dim=dim, rescore=False, use_gpu=False))
    t_store = time.perf_counter() - t0
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    t_start = time.perf_counter()
    builds: dict[tuple[int, str, str], tuple[Any, float]] = {}
    bar = tqdm(settings, desc=f"index settings ({name})", unit="setting", disable=not progress)
    try:
        for s in bar:
            bar.set_postfix_str(s.label)
            if s.shape not in builds:
                if time.perf_counter() - t_start > budget_s:
                    skipped.append(s.label)
                    continue
                builds.clear()   # drop the previous FAISS structure before building the next
                t0 = time.perf_counter()
                built = store.with_config(IndexConfig(dim=s.dim, quant=s.quant, kind=s.kind, rescore=False,
                                                      use_gpu=False))
                builds[s.shape] = (built, time.perf_counter() - t0)
            built, build_s = builds[s.shape]
            variant = built.with_config(IndexConfig(rescore=s.rescore, nprobe=s.nprobe, ef_search=s.ef_search,
                                                    use_gpu=False))
            row = _measure(variant, s, queries, truth, n_latency)
            row["build_s"] = build_s
            rows.append(row)
    finally:
        builds.clear()
        store.close()
        shutil.rmtree(path, ignore_errors=True)
    return {"documents": n, "dim": dim, "queries": len(queries), "ground_truth_s": t_gt,
            "store_build_s": t_store, "rows": rows, "skipped": skipped, "budget_s": budget_s}


def _table(rows: list[dict[str, Any]]) -> str:
    hdr = ["kind", "quant", "dim", "search", "rescore", f"recall@{K}", "FAISS B/doc", "B/doc touched",
           "p50 ms", "p99 ms", "build s"]
    body = []
    for r in rows:
        search = f"nprobe {r['nprobe']}" if r["nprobe"] else f"ef {r['ef_search']}" if r["ef_search"] else "-"
        body.append([r["kind"], r["quant"], r["dim"], search, "yes" if r["rescore"] else "no", r[f"recall@{K}"],
                     round(r["bytes_per_doc_faiss"]), round(r["bytes_per_doc_search"]),
                     r["latency_ms"]["p50"], r["latency_ms"]["p99"], r["build_s"]])
    return md_table(hdr, body)


def _plots(w: ResultWriter, name: str, res: dict[str, Any]) -> None:
    rows = res["rows"]
    pts = [(r["latency_ms"]["p50"], r[f"recall@{K}"]) for r in rows]
    plot_pareto(w.plot_path(f"pareto_{name}.png"), pts, [r["setting"] for r in rows], xlabel="p50 latency per query (ms)",
                ylabel=f"recall@{K} vs exact fp32", title=f"Recall vs latency, {res['documents']:,} x {res['dim']} ({name})")
    # Recall vs bytes per document, by rescoring, for the flat settings at each dim.
    flat = [r for r in rows if r["kind"] == "flat" and not r["rescore"]]
    dims = sorted({r["dim"] for r in flat}, reverse=True)
    quants = [q for q in ("fp32", "fp16", "sq8", "sq4", "pq") if any(r["quant"] == q for r in flat)]
    series = {}
    for q in quants:
        series[q] = [next((r[f"recall@{K}"] for r in flat if r["dim"] == d and r["quant"] == q), float("nan"))
                     for d in dims]
    plot_lines(w.plot_path(f"recall_by_dim_{name}.png"), dims, series, xlabel="dimensions kept (Matryoshka prefix)",
               ylabel=f"recall@{K} (flat, no rescoring)", title=f"Recall by dim and quantisation ({name})")


def run(args: argparse.Namespace) -> int:
    """``qswap bench index``."""
    import numpy as np

    from qswap.bench.data.synthetic import clustered_embeddings

    backends = [b.strip() for b in str(args.backend).split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        raise InvalidInputError(f"unknown backend(s) {bad or args.backend!r}",
                                "use --backend faiss, or a list of " + ", ".join(BACKENDS))
    if backends != ["faiss"]:
        return run_backends(args, backends)
    quick = bool(args.quick)
    n = args.n or (5_000 if quick else 200_000)
    nq = args.queries or (100 if quick else 1000)
    n_lat = args.latency_queries or (30 if quick else 200)
    clusters = args.clusters or (64 if quick else 1024)
    out = results_dir_for(NAME, quick, args.out)
    w = ResultWriter(NAME, out)
    work = args.work or (out / "tmp" / "work")
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"k": K, "sets": {}}

    t0 = time.perf_counter()
    base = clustered_embeddings(n, args.dim, clusters, args.seed)
    queries = clustered_embeddings(nq, args.dim, clusters, args.seed, stream="queries")
    gen_s = time.perf_counter() - t0
    budget = args.budget_s if args.budget_s is not None else (60.0 if quick else 360.0)
    real_budget = budget / 2.5   # the real set is smaller; the whole run stays near ten minutes
    syn = run_set("synthetic", base, queries, work, grid(quick, args.dim), n_lat, budget_s=budget)
    syn["data"] = {"kind": "synthetic clustered unit vectors (qswap.bench.data.clustered_embeddings)",
                   "n": n, "dim": args.dim, "clusters": clusters, "noise": 0.6, "seed": args.seed,
                   "generate_s": gen_s}
    results["sets"]["synthetic"] = syn
    del base

    real_n = args.real_debian if args.real_debian is not None else (0 if quick else 30000)
    real_source = "real embeddings"
    if args.real is None and real_n > 0:
        args.real = real_debian_embeddings(real_n, args.model)
        real_source = (f"real {args.model} embeddings of {real_n:,} distinct Debian one-line descriptions "
                       "(English, document prefix); queries: the last ones, held out")
    if args.real is not None:
        if not Path(args.real).is_file():
            raise InvalidInputError(f"{args.real} does not exist", "give an .npy of (n, dim) float32 embeddings")
        real = np.load(args.real, mmap_mode="r")
        if real.ndim != 2 or len(real) <= args.real_queries + K:
            raise InvalidInputError(f"{args.real} has shape {real.shape}", f"need more than {args.real_queries + K} rows")
        rb = np.ascontiguousarray(real[:-args.real_queries], dtype=np.float32)
        rq = np.ascontiguousarray(real[-args.real_queries:], dtype=np.float32)
        rs = run_set("real", rb, rq, work, grid(quick, int(real.shape[1])), n_lat, budget_s=real_budget)
        rs["data"] = {"kind": real_source, "file": str(args.real), "n": len(rb), "queries": len(rq),
                      "dim": int(real.shape[1])}
        results["sets"]["real"] = rs

    md = [f"Recall@{K} is against exact search over the original float32 full-dimension vectors. "
          "Latency: one query through `DocumentIndex.search` (FAISS + rescoring + document-store "
          "lookup), single process, after 10 warm-up queries. Build: the FAISS structure from the stored "
          "vectors. B/doc touched = FAISS bytes + 768 B of float16 full-dimension vectors when rescoring. "
          "qswap stores vectors as float16, so even exact search over them can miss a near-tie of the float32 "
          "ground truth (recall 0.999 rather than 1).\n"]
    if not quick and n < 1_000_000:
        md.append(f"Scale: {n:,} documents, not 1M: a trial at 1M (`qswap bench index --n 1000000`, kept in "
                  "`trial-1m/`) built only the exact, HNSW and IVF shapes at full dimension within the build "
                  "budget (HNSW 113 s, IVF 183 s to build; exact search 65 ms per query), so the whole grid "
                  "would take well over the ten minutes a run may use on this 2-core machine.\n")
    for name, res in results["sets"].items():
        md.append(f"## {name}: {res['documents']:,} x {res['dim']}, {res['queries']} queries\n")
        md.append(f"Data: {res['data']['kind']}. Ground truth {res['ground_truth_s']:.1f} s; stored index "
                  f"(docstore + float16 log) {res['store_build_s']:.1f} s.\n")
        front = pareto_front([(r["latency_ms"]["p50"], r[f"recall@{K}"]) for r in res["rows"]])
        md.append("Pareto front (no faster setting is as accurate):\n")
        md.append(_table([res["rows"][i] for i in front]))
        md.append("\nAll settings:\n")
        md.append(_table(res["rows"]))
        if res["skipped"]:
            md.append(f"\nSkipped (time budget of {res['budget_s']:.0f} s per set reached): "
                      + ", ".join(res["skipped"]) + "\n")
        _plots(w, name, res)
    w.write(results, "\n".join(md))
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out}")
    return 0


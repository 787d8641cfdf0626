"""``qswap bench index --backend LIST``: index engines side by side on the same vectors, queries and
index options: FAISS (embedded), milvus-lite (embedded) and a Milvus server (``milvus-server``: the
``milvus`` package's standalone build, started for the run by :class:`~qswap.bench.milvus_server.LocalMilvus`
and reached over gRPC on 127.0.0.1).

Each row: recall@10 against exact float32 search, p50/p99 of one query through the backend's
``search`` (with text and metadata, as the server calls it), build time and bytes per document.
A row the backend cannot build (e.g. HNSW_SQ on a Milvus server older than 2.6) is kept as
skipped, with the backend's own reason.

Data: synthetic clustered vectors, real embeddings of Debian short descriptions (``--real-debian``,
``--real``), and/or ``--debian-index``: an index built by ``qswap index build`` from a Debian
benchmark folder (``qswap bench data debian --max-docs 10000``), its stored vectors as documents
and the folder's English queries, encoded by ``--model``, as queries. With ``--http`` (and a
``--debian-index``) the same documents are also served by the real ``qswap serve``, over a FAISS
index and over a collection of the Milvus server (:mod:`qswap.bench.index_http`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

from qswap.bench.plots import plot_pareto
from qswap.bench.results import ResultWriter, md_table, results_dir_for
from qswap.bench.stats import summarize
from qswap.errors import InvalidInputError, QswapError

K = 10
MAX_TEXT_BYTES = 65_535
BACKEND_SETTINGS = [  # (label, IndexConfig options): the same options given to every backend
    ("flat fp32 d{d} (exact)", {"kind": "flat", "quant": "fp32"}),
    ("hnsw fp32 d{d} ef64", {"kind": "hnsw", "quant": "fp32", "ef_search": 64}),
    ("hnsw sq8 d{d} ef64 +rescore", {"kind": "hnsw", "quant": "sq8", "ef_search": 64, "rescore": True}),
    ("ivf sq8 d{d} nprobe16 +rescore", {"kind": "ivf", "quant": "sq8", "nprobe": 16, "rescore": True}),
    ("ivf sq8 d{m} nprobe16 +rescore (MRL)", {"kind": "ivf", "quant": "sq8", "nprobe": 16, "rescore": True,
                                                "mrl": True}),
]


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench index --backend LIST`` (besides ``--backend`` itself)."""
    p.add_argument("--debian-index", type=Path, default=None, metavar="DIR",
                   help="backends mode: also measure this index (built by `qswap index build` from a Debian "
                        "benchmark folder): its stored vectors are the documents, --debian's English queries "
                        "encoded by --model the queries")
    p.add_argument("--debian", type=Path, default=None, metavar="DIR",
                   help="the Debian benchmark folder of --debian-index (default: the corpus its build recorded)")
    p.add_argument("--no-synthetic", action="store_true", help="backends mode: skip the synthetic set")
    from qswap.bench.index_http import add_http_arguments
    add_http_arguments(p)


def recall_at_k(got: list[list[Any]], truth: Any, k: int = K) -> float:
    """Mean share of the exact top-``k`` (row numbers) found by ``got`` (hits whose ids are row numbers)."""
    import numpy as np
    r = [len({int(h.id) for h in g} & set(t[:k].tolist())) / k for g, t in zip(got, truth)]
    return float(np.mean(r))


def recall_and_latency(idx: Any, queries: Any, truth: Any, n_latency: int, batch: int) -> tuple[float, list[float]]:
    """Recall@K of ``idx`` over ``queries`` (searched ``batch`` at a time), then the ms of
    ``n_latency`` single-query searches with text and metadata, as the server calls it, after
    10 warm-up queries."""
    got = []
    for i in range(0, len(queries), batch):
        got += idx.search(queries[i:i + batch], K, with_text=False)
    recall = recall_at_k(got, truth, K)
    for j in range(min(10, n_latency)):
        idx.search(queries[j:j + 1], K)
    lat = []
    for j in range(n_latency):
        t = time.perf_counter()
        idx.search(queries[j:j + 1], K)
        lat.append((time.perf_counter() - t) * 1e3)
    return recall, lat


def real_debian_embeddings(n: int, model: str) -> Path:
    """``n`` Debian one-line descriptions (English, distinct) embedded as documents (cached .npy)."""
    import numpy as np

    from qswap.bench.fixtures import cache_dir, debian_dir
    from qswap.encoders import load_base

    base = load_base(model, device="cpu")
    path = cache_dir() / f"real-debian-short-{n}-{base.space.fingerprint[:10]}.npy"
    if path.is_file():
        return path
    texts = _distinct_texts(debian_dir() / "queries-en.jsonl")
    if len(texts) < n:
        raise InvalidInputError(f"only {len(texts)} distinct descriptions", f"use --real-debian {len(texts)} or less")
    random.Random(0).shuffle(texts)
    x = base.encode_documents(texts[:n], batch_size=64, progress=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, x.astype(np.float32))
    tmp.replace(path)
    return path


def _distinct_texts(path: Path) -> list[str]:
    texts: list[str] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            t = json.loads(line)["text"] if line.strip() else ""
            if t and t not in seen:
                seen.add(t)
                texts.append(t)
    return texts


def debian_index_set(index_dir: Path, data_dir: Path | None, n_queries: int, model: str,
                     seed: int) -> dict[str, Any]:
    """Documents (ids = row numbers, real text and metadata), their stored vectors, the space, and
    ``n_queries`` English queries of the benchmark folder (texts and vectors encoded by ``model``)."""
    import numpy as np

    from qswap.encoders import load_base
    from qswap.index import Document, open_index

    src = open_index(index_dir, read_only=True)
    try:
        ids, vecs = src.export_embeddings()
        # Milvus keeps a text in a VARCHAR of at most 65,535 bytes: the few longer ones are cut,
        # for every backend alike.
        docs = [Document(str(i), d.text.encode("utf-8")[:MAX_TEXT_BYTES].decode("utf-8", "ignore"), d.metadata)
                for i, d in enumerate(src.get(ids)) if d is not None]
        cut = sum(len(d.text.encode("utf-8")) > MAX_TEXT_BYTES for d in src.get(ids) if d is not None)
        space = src.space
        corpus = (src.manifest.get("build") or {}).get("corpus")
    finally:
        src.close()
    data_dir = data_dir or (Path(corpus).parent if corpus else None)
    if data_dir is None or not (Path(data_dir) / "queries-en.jsonl").is_file():
        raise InvalidInputError(f"no queries-en.jsonl for {index_dir}", "name the benchmark folder with --debian DIR")
    texts = _distinct_texts(Path(data_dir) / "queries-en.jsonl")
    random.Random(seed).shuffle(texts)
    texts = texts[:n_queries]
    base = load_base(model, device="cpu")
    space.require_same(base.space, f"--model {model} and {index_dir}")
    q = np.asarray(base.encode_queries(texts), dtype=np.float32)
    return {"docs": docs, "base": np.asarray(vecs, dtype=np.float32), "queries": q, "query_texts": texts,
            "space": space, "data_dir": str(data_dir), "texts_cut": cut}


def _dir_bytes(p: Path | None) -> int | None:
    if p is None:
        return None
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.exists() else 0


def _build(backend: str, cfg: Any, base: Any, work: Path, space: Any, docs: list[Any],
           server: Any) -> tuple[Any, Path | None]:
    """The index of ``docs`` with ``cfg`` on ``backend``; returns (index, what holds it on disk)."""
    from qswap.index import create_index

    if backend == "faiss":
        path = work / "faiss-index"
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(path.with_name(path.name + ".building"), ignore_errors=True)
        return create_index(path, docs, base, space, cfg), path
    from qswap.index.backends.milvus.build import create_collection
    if backend == "milvus-server":
        # One collection per setting, replaced by the next (the server holds every loaded one in memory).
        return create_collection(server.http_uri, "bench", docs, base, space, cfg, replace=True), None
    # A fresh milvus-lite file per setting (its embedded server keeps a file's state while it runs).
    where = work / f"milvus-{time.monotonic_ns()}.db"
    return create_collection(str(where), "bench", docs, base, space, cfg), where


def _backend_row(backend: str, label: str, opts: dict[str, Any], base: Any, queries: Any, truth: Any,
                 work: Path, n_latency: int, space: Any, docs: list[Any], server: Any = None) -> dict[str, Any]:
    from qswap.index import IndexConfig

    dim = base.shape[1]
    opts = dict(opts)
    d = dim // 3 if opts.pop("mrl", False) else dim
    cfg = IndexConfig(dim=d, use_gpu=False, **opts)
    setting = label.format(d=dim, m=d)
    t0 = time.perf_counter()
    try:
        idx, where = _build(backend, cfg, base, work, space, docs, server)
    except QswapError as e:
        if backend == "faiss":
            raise
        return {"backend": backend, "setting": setting, "dim": d, "skipped": str(e)}
    build_s = time.perf_counter() - t0
    try:
        recall, lat = recall_and_latency(idx, queries, truth, n_latency, batch=100)
        info = idx.info()
    finally:
        idx.close()
    size = _dir_bytes(where)
    milvus = info.get("milvus", {})
    return {"backend": backend, "setting": setting, "dim": d, "config": info["config"],
            "native_index": milvus.get("index_type") if milvus else info["faiss"]["factory"],
            f"recall@{K}": recall, "latency_ms": summarize(lat), "build_s": build_s,
            "bytes_on_disk": size, "bytes_per_doc": size / len(docs) if size is not None else None,
            "rescoring": bool(info["rescoring"]), "read_consistency": milvus.get("read_consistency"),
            "full_vectors": ((f"float32 {milvus.get('full_vectors_field', 'vector')} field in Milvus"
                              if milvus.get("full_vectors") else "the vec field itself") if milvus
                             else "qswap float16 log")}


def _data_sets(args: argparse.Namespace, quick: bool) -> list[dict[str, Any]]:
    """The sets measured: synthetic (unless --no-synthetic), --real / --real-debian, --debian-index."""
    import numpy as np

    from qswap.bench.data.synthetic import clustered_embeddings

    out = []
    if not args.no_synthetic:
        n = args.n or (5_000 if quick else 20_000)
        nq = args.queries or (100 if quick else 300)
        clusters = args.clusters or (64 if quick else 256)
        out.append({"name": "synthetic", "base": clustered_embeddings(n, args.dim, clusters, args.seed),
                    "queries": clustered_embeddings(nq, args.dim, clusters, args.seed, stream="queries"),
                    "kind": f"synthetic clustered unit vectors, {clusters} clusters, seed {args.seed}"})
    real_kind = f"real embeddings {args.real}"
    if args.real is None and args.real_debian:
        args.real = real_debian_embeddings(args.real_debian, args.model)
        real_kind = (f"real {args.model} embeddings of {args.real_debian:,} distinct Debian one-line descriptions "
                     f"(English, document prefix); queries: the last {args.real_queries}, held out")
    if args.real is not None:
        real = np.load(args.real, mmap_mode="r")
        if real.ndim != 2 or len(real) <= args.real_queries + K:
            raise InvalidInputError(f"{args.real} has shape {real.shape}", f"need more than {args.real_queries + K} rows")
        out.append({"name": "real", "base": np.ascontiguousarray(real[:-args.real_queries], dtype=np.float32),
                    "queries": np.ascontiguousarray(real[-args.real_queries:], dtype=np.float32), "kind": real_kind})
    if args.debian_index is not None:
        d = debian_index_set(args.debian_index, args.debian, args.queries or (100 if quick else 300), args.model,
                             args.seed)
        d.update(name="debian", kind=(f"the stored vectors of {args.debian_index} ({args.model} embeddings of the "
                                      f"Debian benchmark {d['data_dir']}); queries: {len(d['queries'])} of its "
                                      f"English short descriptions, encoded by {args.model} (seed {args.seed}); "
                                      f"{d['texts_cut']} document text(s) over Milvus's {MAX_TEXT_BYTES:,}-byte "
                                      "VARCHAR cut to it for every backend"))
        out.append(d)
    if not out:
        raise InvalidInputError("no data set to measure", "drop --no-synthetic or give --debian-index / --real")
    return out


def _space_for(name: str, dim: int) -> Any:
    from qswap.space import EmbeddingSpace
    # The vectors are not from a model: a space of their own keeps them apart from real ones.
    return EmbeddingSpace(name=f"bench-{name}", weights_sha256="0" * 64, tokenizer_sha256="0" * 64,
                          pooling="mean", query_prefix="", document_prefix="", normalize=True, dim=dim)


def run_backends(args: argparse.Namespace, backends: list[str]) -> int:
    """``qswap bench index --backend faiss,milvus,milvus-server``: every backend on the same vectors and options."""
    from qswap.bench.data.synthetic import exact_ground_truth
    from qswap.index import Document

    quick = bool(args.quick)
    n_lat = args.latency_queries or (30 if quick else 200)
    out = args.out or results_dir_for("index", quick, None) / "backends"   # --out: this very folder
    w = ResultWriter("index-backends", out)
    work = args.work or (out / "tmp" / "work")
    work.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    server = None
    sets: dict[str, Any] = {}
    results: dict[str, Any] = {"k": K, "backends": backends, "sets": sets, "loadavg_start": load_start}
    try:
        if "milvus-server" in backends or args.http:
            from qswap.bench.milvus_server import LocalMilvus
            shutil.rmtree(work / "milvus-server", ignore_errors=True)   # a run that failed may have left one
            server = LocalMilvus(work / "milvus-server").start()
            results["milvus_server"] = server.facts()
            print(f"Milvus server {server.version} started in {server.start_seconds:.1f} s", flush=True)
        for ds in _data_sets(args, quick):
            name, base, queries = ds["name"], ds["base"], ds["queries"]
            _, truth = exact_ground_truth(base, queries, K)
            dim = base.shape[1]
            space = ds.get("space") or _space_for(name, dim)
            docs = ds.get("docs") or [Document(str(i), f"doc {i}", {"cluster": int(i % 7)}) for i in range(len(base))]
            rows = []
            for label, opts in BACKEND_SETTINGS:
                for b in backends:
                    print(f"{name}: {b}: {label.format(d=dim, m=dim // 3)}", flush=True)
                    rows.append(_backend_row(b, label, opts, base, queries, truth, work, n_lat, space, docs, server))
            sets[name] = {"documents": len(base), "dim": dim, "queries": len(queries), "data": ds["kind"], "rows": rows}
            if args.http and "query_texts" in ds:
                from qswap.bench.index_http import serve_side_by_side
                sets[name]["http"] = serve_side_by_side(args, ds, server, work)
    finally:
        if server is not None:
            server.stop()
    results["loadavg_end"] = os.getloadavg()
    _write(w, results, backends, load_start)
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out}")
    return 0


def _write(w: ResultWriter, results: dict[str, Any], backends: list[str], load_start: Any) -> None:
    srv = results.get("milvus_server")
    md = [f"Backends side by side on the same vectors, queries and index options. Recall@{K} against exact "
          "float32 search; latency: one query through the backend's `search` (with text and metadata), after "
          "10 warm-up queries, single process; build: documents + vectors in, index built and loaded; "
          "bytes/doc: everything on disk (FAISS: index folder with docs.sqlite and the float16 log; milvus: the "
          "milvus-lite database; not measured for the server). `milvus` is milvus-lite (embedded, same client "
          "API); `milvus-server` is a Milvus server process on this machine reached over gRPC on 127.0.0.1"
          + (f" ({srv['server_version']}, the `{srv['package']}` package's standalone build, started in "
             f"{srv['start_seconds']} s)" if srv else "")
          + "".join(f"; Milvus reads at {c} consistency" for c in sorted({r.get("read_consistency") for res in
                    results["sets"].values() for r in res["rows"] if r.get("read_consistency")}))
          + f". Load average at start {load_start[0]:.2f}, end {results['loadavg_end'][0]:.2f} (2 shared cores).\n"]
    for name, res in results["sets"].items():
        md.append(f"## {name}: {res['documents']:,} x {res['dim']}, {res['queries']} queries\n")
        md.append(f"Data: {res['data']}.\n")
        done = [r for r in res["rows"] if "skipped" not in r]
        hdr = ["setting", "backend", "native index", f"recall@{K}", "p50 ms", "p99 ms", "build s", "bytes/doc",
               "full vectors for rescoring"]
        md.append(md_table(hdr, [[r["setting"], r["backend"], r["native_index"], r[f"recall@{K}"],
                                  r["latency_ms"]["p50"], r["latency_ms"]["p99"], r["build_s"],
                                  round(r["bytes_per_doc"]) if r["bytes_per_doc"] is not None else "-",
                                  r["full_vectors"] if r["rescoring"] else "-"] for r in done]))
        skipped = [r for r in res["rows"] if "skipped" in r]
        if skipped:
            md.append("\nSkipped: " + "; ".join(f"{r['setting']} on {r['backend']}: {r['skipped']}" for r in skipped)
                      + "\n")
        pts = [(r["latency_ms"]["p50"], r[f"recall@{K}"]) for r in done]
        plot_pareto(w.plot_path(f"backends_{name}.png"), pts, [f"{r['backend']}: {r['setting']}" for r in done],
                    xlabel="p50 latency per query (ms)", ylabel=f"recall@{K} vs exact fp32",
                    title=f"FAISS vs Milvus, {res['documents']:,} x {res['dim']} ({name})")
        if "http" in res:
            from qswap.bench.index_http import http_markdown
            md.append(http_markdown(res["http"]))
    w.write(results, "\n".join(md))

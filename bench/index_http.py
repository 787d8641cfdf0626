"""``qswap bench index --backend ... --debian-index DIR --http``: search through the real server,
``qswap serve`` over a FAISS index vs over a collection of a Milvus server, side by side.

Both servers run at once (child processes on 127.0.0.1, the same base model and query encoder,
the server's default query runtime), over the same documents and vectors (the ``--debian-index``
set) with the same index options (:data:`HTTP_SETTING`: one that every Milvus version builds).
Load is :mod:`qswap.bench.loadgen`'s closed loop (``c`` keep-alive connections); the arms
alternate round by round (A B, B A) at every level. Each response's ``took_ms`` and timings split
the time into HTTP+client, queue, encode, search (the index engine, incl. the gRPC round trip to
Milvus) and other.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from typing import Any

from qswap.bench.fixtures import breakdown, qswap_server, search_requests, wait_for_runtime
from qswap.bench.load_options import ByMode, LoadDefaults, LoadOptions, add_load_arguments, warm_up
from qswap.bench.loadgen import LoadResult
from qswap.bench.processes import rss_bytes
from qswap.bench.results import md_table
from qswap.bench.stats import interleaved, ratio_summary, summarize

#: The index options both servers use: HNSW over float32 vectors (no HNSW_SQ before Milvus 2.6).
HTTP_SETTING = ("hnsw fp32 ef64", {"kind": "hnsw", "quant": "fp32", "ef_search": 64})
#: Load of the ``--http`` arms: full run and ``--quick``.
HTTP_LOAD = LoadDefaults(levels=ByMode((1, 8), (1, 8)), seconds=ByMode(6.0, 2.0), requests=ByMode(1500, 40),
                         rounds=ByMode(2, 1), rounds_help="A/B rounds per level of --http")
ARMS = ("faiss", "milvus-server")
COLLECTION = "qswap_http_bench"


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    """``--http`` and its load options."""
    p.add_argument("--http", action="store_true",
                   help="with --debian-index: also search through `qswap serve` over FAISS and over a Milvus "
                        "server collection (same documents, encoder and options), at --concurrency levels")
    add_load_arguments(p, HTTP_LOAD)


def _stores(ds: dict[str, Any], server: Any, work: Any) -> tuple[str, str, dict[str, Any]]:
    """The FAISS index folder and the Milvus collection location of the set, built with HTTP_SETTING."""
    from qswap.index import IndexConfig, create_index
    from qswap.index.backends.milvus.build import create_collection

    cfg = IndexConfig(use_gpu=False, **HTTP_SETTING[1])
    path = work / "http-faiss"
    shutil.rmtree(path, ignore_errors=True)
    create_index(path, ds["docs"], ds["base"], ds["space"], cfg).close()
    coll = create_collection(server.http_uri, COLLECTION, ds["docs"], ds["base"], ds["space"], cfg, replace=True)
    info = coll.info()
    coll.close()
    return str(path), f"{server.uri}?collection={COLLECTION}", info


def serve_side_by_side(args: argparse.Namespace, ds: dict[str, Any], server: Any, work: Any) -> dict[str, Any]:
    """Latency and QPS of ``POST /v1/search`` through ``qswap serve`` over each store, interleaved."""
    opts = LoadOptions.from_args(args, HTTP_LOAD)
    faiss_dir, milvus_loc, info = _stores(ds, server, work)
    enc_root = work / "http-encoders"
    enc_root.mkdir(parents=True, exist_ok=True)
    srvs = {"faiss": qswap_server(faiss_dir, enc_root, work / "state-faiss", work / "serve-faiss.log", model=args.model),
            "milvus-server": qswap_server(milvus_loc, enc_root, work / "state-milvus", work / "serve-milvus.log",
                                          model=args.model)}
    make = search_requests(ds["query_texts"], ["base"], k=10)
    res: dict[str, Any] = {"setting": HTTP_SETTING[0], "milvus_index": info["milvus"], "levels": opts.levels,
                           "seconds_per_run": opts.seconds, "max_requests_per_run": opts.requests,
                           "rounds": opts.rounds, "queries": len(ds["query_texts"]), "servers": {}}
    per: dict[str, dict[int, list[LoadResult]]] = {a: {} for a in ARMS}
    try:
        for a in ARMS:
            srvs[a].start()
            res["servers"][a] = {"command": srvs[a].command, "start_s": srvs[a].start_seconds,
                                 "runtime_wait_s": wait_for_runtime(srvs[a], ["base"], "onnx-shared")}
        for a in ARMS:
            warm_up(srvs[a].port, make, concurrency=4, requests=64, duration_s=30)
        for c in opts.levels:
            got = interleaved({a: (lambda a=a, c=c: opts.run(srvs[a].port, make, c, keep_bodies=True)) for a in ARMS},
                              rounds=opts.rounds, warmup=0)
            for a, rs in got.items():
                per[a][c] = rs
            print(f"http c={c}: " + ", ".join(f"{a} p50 {summarize([x for r in rs for x in r.latencies_ms()])['p50']:.1f} ms"
                                               for a, rs in got.items()), file=sys.stderr)
        for a in ARMS:
            res["servers"][a]["rss_bytes_end"] = srvs[a].rss()
        res["milvus_server_rss_bytes_end"] = rss_bytes(server.pid) if server.pid else None
    finally:
        for s in srvs.values():
            s.stop()
    res["arms"] = {a: _summary(per[a]) for a in ARMS}
    res["p50_ratio_milvus_over_faiss"] = {
        str(c): {"pooled": res["arms"]["milvus-server"][str(c)]["latency_ms"]["p50"]
                 / res["arms"]["faiss"][str(c)]["latency_ms"]["p50"],
                 "rounds": ratio_summary([summarize(r.latencies_ms())["p50"] for r in per["milvus-server"][c]],
                                         [summarize(r.latencies_ms())["p50"] for r in per["faiss"][c]]).to_dict()}
        for c in opts.levels}
    return res


def _summary(by_c: dict[int, list[LoadResult]]) -> dict[str, Any]:
    rows = {}
    for c, rs in by_c.items():
        merged = LoadResult([s for r in rs for s in r.samples], sum(r.elapsed_s for r in rs), c, "")
        rows[str(c)] = {"qps_rounds": [r.qps for r in rs], "qps": summarize([r.qps for r in rs], (50,))["p50"],
                        "latency_ms": summarize(merged.latencies_ms()), "sent": sum(r.sent for r in rs),
                        "failed": sum(r.failed for r in rs), "errors": merged.errors(),
                        "breakdown_ms": breakdown(merged)}
    return rows


def http_markdown(res: dict[str, Any]) -> str:
    """The ``--http`` section of the README."""
    rows = []
    for c in res["levels"]:
        for a in ARMS:
            r = res["arms"][a][str(c)]
            b = r["breakdown_ms"]
            ratio = res["p50_ratio_milvus_over_faiss"][str(c)]["pooled"] if a != "faiss" else None
            rows.append([c, a, r["qps"], r["latency_ms"]["p50"], r["latency_ms"]["p99"],
                         f"{ratio:.2f}x" if ratio else "-", b["http_client_p50"], b["encode_p50"], b["search_p50"],
                         r["failed"]])
    mi = res["milvus_index"]
    srv = res["servers"]
    return (f"\n### Through `qswap serve`: FAISS vs the Milvus server\n\n"
            f"`POST /v1/search` (k=10, the base encoder, real English queries) to two `qswap serve` processes "
            f"running at once over the same documents with the same index options ({res['setting']}; Milvus "
            f"{mi['index_type']} {mi['params']}, search {mi['search_params']}), the server's default query runtime. "
            f"Closed loop on 127.0.0.1; per level {res['rounds']} round(s) per arm, alternating, each at most "
            f"{res['max_requests_per_run']} requests or {res['seconds_per_run']:g} s. search p50 = the server's "
            "index time per request (for Milvus: the gRPC call to the server and reading its answer).\n\n"
            + md_table(["conc.", "index", "QPS", "p50 ms", "p99 ms", "p50 / FAISS", "HTTP+client p50", "encode p50",
                        "search p50", "failed"], rows)
            + f"\nRSS at the end: qswap over FAISS {srv['faiss']['rss_bytes_end'] / 2**20:.0f} MiB, qswap over "
              f"Milvus {srv['milvus-server']['rss_bytes_end'] / 2**20:.0f} MiB, the Milvus server "
              f"{(res['milvus_server_rss_bytes_end'] or 0) / 2**20:.0f} MiB.\n")

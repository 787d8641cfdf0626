"""Serving benchmark: latency and QPS of ``POST /v1/search`` against concurrency.

The server is the real one, ``qswap serve``, run as a child process on 127.0.0.1 with the
real model (multilingual-e5-small, bundled). Load comes from :mod:`qswap.bench.loadgen`
(closed loop: ``c`` keep-alive connections, each sending its next query when the last
answer arrived), bounded in requests and seconds per run.

Two arms are measured side by side at every concurrency, alternating run by run (A B B A):
all requests to one encoder, and requests spread round-robin over 8 encoders (mixed
traffic). Both arms use LoRA encoders over the shared base (random adapters: speed does
not depend on what they learned). Each response's ``took_ms`` and per-query timings give
the time breakdown: HTTP + client (client latency minus ``took_ms``), queue (waiting for a
batch), encode (the batch's forward pass), search (the batch's index search), other.

Documents: the Debian package-descriptions corpus (``qswap bench data debian``, ~60k
texts) stored with **synthetic** embeddings stamped with the real model's embedding space.
Embedding the 60k long descriptions with e5-small on this 2-core machine runs at ~30 docs/s
when the machine is otherwise idle and ~8 docs/s when shared (35 minutes to two hours), so
the index vectors are clustered random unit vectors; queries are
real Debian short descriptions (en/de/fr/it) encoded by the real model on every request.
Latency is representative (same sizes, same code path); the hits are not meaningful.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qswap.encoders.runtime.backend import BACKENDS
from qswap.encoders.precision import PRECISIONS
from qswap.bench.load_options import ByMode, LoadDefaults, LoadOptions, RunDirs, add_load_arguments, add_model_argument, warm_up
from qswap.bench.results import ResultWriter, md_table
from qswap.bench.stats import interleaved, ratio_summary, summarize
from qswap.bench.plots import plot_bars, plot_lines
from qswap.bench.fixtures import (MODEL, breakdown, index_meta, load_space_base, load_workload, lora_encoders, qswap_server,
                                  register, search_requests, stamped_index, wait_for_runtime)
from qswap.bench.loadgen import LoadResult

NAME = "serving"
N_ENCODERS = 8
#: Load options of ``qswap bench serving``: full run and ``--quick``.
LOAD = LoadDefaults(levels=ByMode((1, 2, 4, 8, 16, 32, 64), (1, 4)), seconds=ByMode(8.0, 2.0),
                    requests=ByMode(3000, 40), rounds=ByMode(2, 1), rounds_help="A/B rounds per level")


# --------------------------------------------------------------------------- the benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench serving``."""
    add_load_arguments(p, LOAD)
    add_model_argument(p, MODEL)
    p.add_argument("--backend", choices=BACKENDS, default="shared",
                   help="the server's query-encoder backend (default: shared, the server's default); with shared "
                        "or onnx, timing starts once every encoder runs on ONNX Runtime")
    p.add_argument("--query-precision", choices=PRECISIONS, default="fp32",
                   help="the server's --query-precision (torch backend; default: fp32)")
    p.add_argument("--embeddings", action="store_true",
                   help="measure POST /v1/embeddings beside /v1/search instead (1 and 32 texts per call, "
                        "concurrency 1/8/32 by default; results in bench/results/serving/embeddings)")
    from qswap.bench import ray_serving
    ray_serving.add_arguments(p)




def run(args: argparse.Namespace) -> int:
    """``qswap bench serving``."""
    if getattr(args, "ray", False):
        if args.hop:
            from qswap.bench import ray_hop
            return ray_hop.run(args)
        from qswap.bench import ray_serving
        return ray_serving.run(args)
    if getattr(args, "embeddings", False):
        from qswap.bench import serving_embeddings
        return serving_embeddings.run(args)
    opts = LoadOptions.from_args(args, LOAD)
    quick, levels = opts.quick, opts.levels
    dirs = RunDirs.create(NAME, quick, args.out)
    tmp = dirs.tmp

    work = load_workload(quick)
    base = load_space_base(args.model)
    idx_dir, _, _ = stamped_index(work, base, tag="default")
    names = [(f"d{i}", "1") for i in range(N_ENCODERS)]
    enc_root = lora_encoders(base, names)
    del base
    srv = qswap_server(idx_dir, enc_root, tmp / "state", tmp / "server.log", model=args.model,
                       extra=["--backend", args.backend, "--query-precision", args.query_precision])
    results: dict[str, Any] = {"backend": args.backend, "query_precision": args.query_precision,
                               "workload": work.source, "index": index_meta(idx_dir),
                               "vectors": "synthetic clustered unit vectors stamped with the model's space",
                               "encoders": f"{N_ENCODERS} random LoRA adapters (rank 32, all dense layers)",
                               "levels": levels, "seconds_per_run": opts.seconds,
                               "max_requests_per_run": opts.requests, "rounds": opts.rounds, "arms": {}}
    with srv:
        results["server"] = {"command": srv.command, "start_s": srv.start_seconds}
        reg_s = [register(srv, f"{n}-{v}")[1] for n, v in names]
        results["registration_s"] = summarize(reg_s)
        keys = [f"{n}@{v}" for n, v in names]
        if args.backend != "torch":
            results["runtime_wait_s"] = wait_for_runtime(
                srv, ["base", *keys], "onnx-shared" if args.backend == "shared" else args.backend)
        arms = {"1 encoder": search_requests(work.queries, keys[:1]),
                "8 encoders": search_requests(work.queries, keys)}
        # Warm-up: every adapter loaded and its code paths run before anything is timed.
        warm_up(srv.port, arms["8 encoders"], concurrency=4, requests=64, duration_s=30)
        per: dict[str, dict[int, list[LoadResult]]] = {a: {} for a in arms}
        for c in levels:
            def one(arm: str, c: int = c) -> LoadResult:
                return opts.run(srv.port, arms[arm], c, keep_bodies=True)
            got = interleaved({a: (lambda a=a: one(a)) for a in arms}, rounds=opts.rounds, warmup=0)
            for a, rs in got.items():
                per[a][c] = rs
            print(f"c={c}: " + ", ".join(f"{a} {sum(r.qps for r in rs) / len(rs):.1f} qps" for a, rs in got.items()),
                  file=sys.stderr)
        results["server"]["rss_bytes_end"] = srv.rss()
    results["arms"] = _summaries(per)
    results["ratios_8_vs_1"] = _ratios(per, levels)
    _write(dirs.writer, results, levels)
    dirs.clean_scratch()
    print(f"wrote {dirs.out}")
    return 0


def _summaries(per: dict[str, dict[int, list[LoadResult]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm, by_c in per.items():
        rows = {}
        for c, rs in by_c.items():
            lat = [x for r in rs for x in r.latencies_ms()]
            merged = LoadResult([s for r in rs for s in r.samples], sum(r.elapsed_s for r in rs), c, "")
            rows[str(c)] = {
                "qps_rounds": [r.qps for r in rs], "qps": summarize([r.qps for r in rs], (50,))["p50"],
                "latency_ms": summarize(lat), "sent": sum(r.sent for r in rs),
                "failed": sum(r.failed for r in rs), "errors": merged.errors(),
                "breakdown_ms": breakdown(merged)}
        out[arm] = rows
    return out


def _ratios(per: dict[str, dict[int, list[LoadResult]]], levels: list[int]) -> dict[str, Any]:
    out = {}
    for c in levels:
        a, b = per["8 encoders"][c], per["1 encoder"][c]
        out[str(c)] = {"qps": ratio_summary([r.qps for r in a], [r.qps for r in b]).to_dict(),
                       "p99": ratio_summary([summarize(r.latencies_ms())["p99"] for r in a],
                                            [summarize(r.latencies_ms())["p99"] for r in b]).to_dict()}
    return out


def _write(w: ResultWriter, res: dict[str, Any], levels: list[int]) -> None:
    arms = res["arms"]
    lat = {f"{a} {p}": [arms[a][str(c)]["latency_ms"][p] for c in levels] for a in arms for p in ("p50", "p99")}
    plot_lines(w.plot_path("latency_vs_concurrency.png"), levels, lat, xlabel="concurrent connections",
               ylabel="latency (ms)", title="/v1/search latency", logx=True, logy=True)
    qps = {a: [arms[a][str(c)]["qps"] for c in levels] for a in arms}
    bands = {a: ([min(arms[a][str(c)]["qps_rounds"]) for c in levels], [max(arms[a][str(c)]["qps_rounds"]) for c in levels])
             for a in arms}
    plot_lines(w.plot_path("qps_vs_concurrency.png"), levels, qps, xlabel="concurrent connections",
               ylabel="successful requests / s", title="/v1/search throughput (band: min-max of rounds)",
               logx=True, bands=bands)
    parts = ("http_client", "queue", "encode", "search", "other")
    mixed = arms["8 encoders"]
    plot_bars(w.plot_path("breakdown.png"), [str(c) for c in levels],
              {p: [max(0.0, mixed[str(c)]["breakdown_ms"][f"{p}_mean"]) for c in levels] for p in parts},
              ylabel="mean ms per request", title="Where the time goes (8 encoders, by concurrency)", stacked=True)

    rows = []
    for c in levels:
        r1, r8 = arms["1 encoder"][str(c)], arms["8 encoders"][str(c)]
        ratio = res["ratios_8_vs_1"][str(c)]["qps"]
        rows.append([c, r1["qps"], r1["latency_ms"]["p50"], r1["latency_ms"]["p95"], r1["latency_ms"]["p99"],
                     r8["qps"], r8["latency_ms"]["p50"], r8["latency_ms"]["p95"], r8["latency_ms"]["p99"],
                     f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})", r1["failed"] + r8["failed"]])
    table = md_table(["conc.", "1 enc QPS", "p50 ms", "p95 ms", "p99 ms", "8 enc QPS", "p50 ms", "p95 ms", "p99 ms",
                      "QPS 8/1 (range)", "failed"], rows)
    brows = []
    for c in levels:
        b = mixed[str(c)]["breakdown_ms"]
        brows.append([c] + [b[f"{p}_mean"] for p in parts] + [b[f"{p}_p50"] for p in ("queue", "encode", "search")])
    btable = md_table(["conc.", "HTTP+client", "queue", "encode", "search", "other", "queue p50", "encode p50",
                       "search p50"], brows)
    idx = res["index"]["config"]
    md = (f"Workload: {res['workload']}. Index: {res['index']['documents']:,} documents, "
          f"{idx['kind']} {idx['quant']} dim {idx['dim']}, rescore {idx['rescore']} (qswap's default for this size); "
          f"**vectors: {res['vectors']}** (embedding the 60k documents with e5-small here runs at ~30 docs/s idle, "
          "~8 docs/s shared: 35 minutes to two hours), queries: real "
          f"text encoded by the real model per request. Encoders: {res['encoders']}.\n\n"
          f"Each level: {res['rounds']} round(s) per arm, alternating, each at most {res['max_requests_per_run']} "
          f"requests or {res['seconds_per_run']:g} s; server backend: {res.get('backend', 'torch')}, "
          f"query precision {res.get('query_precision', 'fp32')}"
          + (f" (every encoder on it after {res['runtime_wait_s']:.0f} s)" if "runtime_wait_s" in res else "")
          + "; closed loop on 127.0.0.1, client and server share the "
          f"machine's cores. QPS = median over rounds; latency percentiles pool the rounds.\n\n"
          f"{table}\n### Time breakdown, 8 encoders (mean ms per request)\n\n"
          "HTTP+client = client-measured latency minus the server's `took_ms`; queue/encode/search from "
          f"the response's `timings`.\n\n{btable}")
    w.write(res, md)

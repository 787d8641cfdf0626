"""``qswap bench serving --embeddings``: ``POST /v1/embeddings`` beside ``POST /v1/search``.

One real server (``qswap serve``, the real multilingual-e5-small, the same stamped index and
random LoRA encoder as ``qswap bench serving``), one encoder, the same real query texts. Arms,
measured alternately at each concurrency (A B C D, then reversed): search with 1 query per
call, embeddings with 1 input per call, search with 32 queries per call, embeddings with 32
inputs per call. Embeddings answer base64 float32 (what the official ``openai`` client asks
for by default). Search does strictly more work (the same forward pass, then the index search),
so the target is embeddings no slower than search.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from qswap.bench.fixtures import (index_meta, load_space_base, load_workload, lora_encoders, qswap_server, register,
                                  stamped_index, wait_for_runtime)
from qswap.bench.load_options import ByMode, LoadDefaults, LoadOptions, RunDirs, warm_up
from qswap.bench.loadgen import LoadResult, Request
from qswap.bench.plots import plot_lines
from qswap.bench.results import md_table
from qswap.bench.stats import interleaved, summarize

NAME = "serving/embeddings"
LOAD = LoadDefaults(levels=ByMode((1, 8, 32), (1, 8)), seconds=ByMode(6.0, 2.0), requests=ByMode(2000, 40),
                    rounds=ByMode(2, 1), rounds_help="rounds per arm and level")
BATCHES = (1, 32)
_HDR = (("Content-Type", "application/json"),)


def _requests(route: str, texts: list[str], key: str, per_call: int) -> Callable[[int], Request]:
    """Request ``i``: ``per_call`` consecutive texts from ``i * per_call``, on ``route``."""
    n = len(texts)

    def body(i: int) -> bytes:
        batch = [texts[(i * per_call + j) % n] for j in range(per_call)]
        if route == "/v1/search":
            return json.dumps({"queries": batch, "encoder": key, "k": 10, "with_text": False}).encode()
        return json.dumps({"input": batch, "model": key, "encoding_format": "base64"}).encode()
    pre = [body(i) for i in range(max(1, n // per_call))]

    def make(i: int) -> Request:
        return Request("POST", route, pre[i % len(pre)], _HDR, key)
    return make


def run(args: argparse.Namespace) -> int:
    """``qswap bench serving --embeddings``."""
    opts = LoadOptions.from_args(args, LOAD)
    levels = opts.levels
    dirs = RunDirs.create(NAME, opts.quick, args.out)
    work = load_workload(opts.quick)
    base = load_space_base(args.model)
    idx_dir, _, _ = stamped_index(work, base, tag="default")
    enc_root = lora_encoders(base, [("d0", "1")])
    del base
    srv = qswap_server(idx_dir, enc_root, dirs.tmp / "state", dirs.tmp / "server.log", model=args.model,
                       extra=["--backend", args.backend])
    res: dict[str, Any] = {"backend": args.backend, "workload": work.source, "index": index_meta(idx_dir),
                           "encoder": "one random LoRA adapter (rank 32, all dense layers)",
                           "embeddings_format": "base64", "levels": levels, "seconds_per_run": opts.seconds,
                           "max_requests_per_run": opts.requests, "rounds": opts.rounds}
    with srv:
        res["server"] = {"command": srv.command, "start_s": srv.start_seconds}
        register(srv, "d0-1")
        if args.backend != "torch":
            res["runtime_wait_s"] = wait_for_runtime(srv, ["base", "d0@1"],
                                                     "onnx-shared" if args.backend == "shared" else args.backend)
        arms = {f"{name} x{b}": _requests(route, work.queries, "d0@1", b)
                for b in BATCHES for name, route in (("search", "/v1/search"), ("embeddings", "/v1/embeddings"))}
        for make in arms.values():
            warm = warm_up(srv.port, make, concurrency=4, requests=32, duration_s=20)
            if warm.failed:
                raise RuntimeError(f"warm-up failed: {warm.errors()}")
        per: dict[str, dict[int, list[LoadResult]]] = {a: {} for a in arms}
        for c in levels:
            got = interleaved({a: (lambda a=a, c=c: opts.run(srv.port, arms[a], c)) for a in arms},
                              rounds=opts.rounds, warmup=0)
            for a, rs in got.items():
                per[a][c] = rs
            print(f"c={c}: " + ", ".join(f"{a} {sum(r.qps for r in rs) / len(rs):.1f}/s" for a, rs in got.items()),
                  file=sys.stderr)
        res["server"]["rss_bytes_end"] = srv.rss()
    res["arms"] = {a: {str(c): {"qps_rounds": [r.qps for r in rs], "qps": summarize([r.qps for r in rs], (50,))["p50"],
                                "latency_ms": summarize([x for r in rs for x in r.latencies_ms()]),
                                "failed": sum(r.failed for r in rs),
                                "errors": LoadResult([x for r in rs for x in r.samples], 0.0, c, "").errors()}
                            for c, rs in by_c.items()}
                   for a, by_c in per.items()}
    _write(dirs, res, levels)
    dirs.clean_scratch()
    print(f"wrote {dirs.out}")
    return 0


def _write(dirs: RunDirs, res: dict[str, Any], levels: list[int]) -> None:
    arms, w = res["arms"], dirs.writer
    plot_lines(w.plot_path("qps_vs_concurrency.png"), levels, {a: [arms[a][str(c)]["qps"] for c in levels] for a in arms},
               xlabel="concurrent connections", ylabel="calls / s", title="/v1/embeddings beside /v1/search",
               logx=True)
    rows = []
    for b in BATCHES:
        s, e = arms[f"search x{b}"], arms[f"embeddings x{b}"]
        for c in levels:
            sc, ec = s[str(c)], e[str(c)]
            rows.append([b, c, sc["qps"], sc["latency_ms"]["p50"], ec["qps"], ec["latency_ms"]["p50"],
                         ec["qps"] / sc["qps"] if sc["qps"] else float("nan"), sc["failed"] + ec["failed"]])
    table = md_table(["texts/call", "conc.", "search calls/s", "search p50 ms", "embeddings calls/s",
                      "embeddings p50 ms", "QPS embeddings/search", "failed"], rows)
    idx = res["index"]
    md = (f"One server ({res['backend']} backend), encoder: {res['encoder']}; the same real query texts on both "
          f"routes; embeddings answered as {res['embeddings_format']}. Search: k=10 over {idx['documents']:,} "
          f"documents, no texts returned. Arms alternate at each level, {res['rounds']} round(s) each, at most "
          f"{res['max_requests_per_run']} calls or {res['seconds_per_run']:g} s per run; closed loop on 127.0.0.1. "
          f"calls/s = median over rounds; p50 pools the rounds.\n\n{table}")
    w.write(res, md)

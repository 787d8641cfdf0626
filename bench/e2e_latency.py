"""``qswap bench e2e``: end-to-end ``/v1/search`` latency at concurrency 1 against the forward pass.

Sends single-query searches one at a time (keep-alive HTTP/1.1) to a running server and
compares the client-side p50 with the p50 of the server-reported ``encode_ms`` (the query
encoder's forward pass inside the same process): the ratio is what HTTP, batching and FAISS
add on top of the floor. Start the server first, e.g. ``qswap serve --backend onnx``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from typing import Any
from urllib.parse import urlparse

from qswap.bench.harness import ResultWriter, md_table

QUERIES = ["chess engine with a graphical board", "audio editor for podcasts", "molecular dynamics simulation",
           "network packet sniffer", "music player for the terminal", "spreadsheet library for python",
           "astronomy planetarium software", "card game solitaire"]


def register(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("e2e", help="end-to-end /v1/search p50 at concurrency 1 vs the encoder forward",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--label", default="server", help="what the server runs (recorded), e.g. 'onnx'")
    p.add_argument("--out", default=None)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    writer = ResultWriter("e2e", args.out)
    u = urlparse(args.url)
    if u.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("qswap bench e2e targets loopback only")
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)
    client, took, encode, search, queue_ms = [], [], [], [], []
    for i in range(args.warmup + args.requests):
        body = json.dumps({"query": QUERIES[i % len(QUERIES)], "k": 10, "with_text": False})
        t0 = time.perf_counter()
        conn.request("POST", "/v1/search", body, {"content-type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        dt = (time.perf_counter() - t0) * 1000
        if resp.status != 200:
            raise SystemExit(f"HTTP {resp.status}: {data}")
        if i >= args.warmup:
            t = data["results"][0]["timings"]
            client.append(dt); took.append(data["took_ms"]); encode.append(t["encode_ms"])
            search.append(t["search_ms"]); queue_ms.append(t["queue_ms"])
    med = {n: statistics.median(v) for n, v in
           (("client", client), ("server_took", took), ("encode", encode), ("search", search), ("queue", queue_ms))}
    ratio = med["client"] / med["encode"]
    results = {"label": args.label, "requests": args.requests, "p50_ms": med,
               "p99_client_ms": sorted(client)[int(0.99 * (len(client) - 1))], "ratio_client_over_encode": ratio}
    md = (f"Server: {args.label} at {args.url}; {args.requests} sequential single-query searches (k=10) after "
          f"{args.warmup} warm-up.\n\n"
          + md_table(["p50 client ms", "p50 server took ms", "p50 queue ms", "p50 encode ms", "p50 search ms",
                      "client / encode"],
                     [[f"{med['client']:.2f}", f"{med['server_took']:.2f}", f"{med['queue']:.2f}",
                       f"{med['encode']:.2f}", f"{med['search']:.2f}", f"{ratio:.2f}x"]]) + "\n")
    print(md)
    writer.write(results, md)
    return 0

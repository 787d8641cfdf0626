"""``qswap bench e2e``: end-to-end ``/v1/search`` latency at concurrency 1 against the forward pass.

Sends single-query searches one at a time (keep-alive HTTP/1.1) to a running server and
compares the client-side p50 with the p50 of the server-reported ``encode_ms`` (the query
encoder's forward pass inside the same process): the ratio is what HTTP, batching and FAISS
add on top of the floor. Start the server first, e.g. ``qswap serve --backend onnx``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from typing import Any
from urllib.parse import urlparse

from qswap.bench.results import ResultWriter, md_table
from qswap.bench.loadgen import Request, check_loopback, run_load_sync

QUERIES = ["chess engine with a graphical board", "audio editor for podcasts", "molecular dynamics simulation",
           "network packet sniffer", "music player for the terminal", "spreadsheet library for python",
           "astronomy planetarium software", "card game solitaire"]


def register(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("e2e", help="end-to-end /v1/search p50 at concurrency 1 vs the encoder forward",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--encoder", default=None,
                   help="encoder key sent with every search (default: the server's default encoder); "
                        "`qswap bench scale` measures base and a LoRA encoder side by side on its own server")
    p.add_argument("--label", default="server", help="what the server runs (recorded), e.g. 'onnx'")
    p.add_argument("--out", default=None)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    writer = ResultWriter("e2e", args.out)
    u = urlparse(args.url)
    host, port = check_loopback(u.hostname or ""), u.port or 80
    # The raw-asyncio client of the load benchmarks: http.client or httpx would add ~0.5 ms of
    # client time per request to a number meant to measure the server.
    extra = {"encoder": args.encoder} if args.encoder else {}
    reqs = [Request.post_json("/v1/search", {"query": q, "k": 10, "with_text": False, **extra}) for q in QUERIES]
    run = functools.partial(run_load_sync, host, port, concurrency=1, duration_s=600.0, keep_bodies=True)
    run(reqs, max_requests=args.warmup)
    res = run(reqs, max_requests=args.requests)
    bad = [s for s in res.samples if s.status != 200]
    if bad:
        raise SystemExit(f"{len(bad)} of {res.sent} searches failed (first: HTTP {bad[0].status} {bad[0].error} "
                         f"{(bad[0].body or b'')[:200]!r})")
    # HTTP floor: the same client and connection handling on a route that does no work.
    floor = run([Request("GET", "/healthz")], max_requests=args.requests)
    client = [s.latency_s * 1000 for s in res.samples]
    bodies = [json.loads(s.body or b"{}") for s in res.samples]
    took = [b["took_ms"] for b in bodies]
    t = [b["results"][0]["timings"] for b in bodies]
    med = {n: statistics.median(v) for n, v in
           (("client", client), ("server_took", took), ("encode", [x["encode_ms"] for x in t]),
            ("search", [x["search_ms"] for x in t]), ("queue", [x["queue_ms"] for x in t]),
            ("healthz", [s.latency_s * 1000 for s in floor.samples]))}
    ratio = med["client"] / med["encode"]
    results = {"label": args.label, "encoder": args.encoder, "requests": args.requests, "p50_ms": med,
               "p99_client_ms": sorted(client)[int(0.99 * (len(client) - 1))], "ratio_client_over_encode": ratio}
    md = (f"Server: {args.label} at {args.url}, encoder {args.encoder or '(default)'}; {args.requests} sequential single-query searches (k=10) after "
          f"{args.warmup} warm-up, one keep-alive connection, raw asyncio client (`qswap.bench.loadgen`). "
          "`encode` is the server-reported query encoding (tokenisation and forward pass); `healthz` is the "
          "same client on a route that does no work (the HTTP floor).\n\n"
          + md_table(["p50 client ms", "p50 server took ms", "p50 queue ms", "p50 encode ms", "p50 search ms",
                      "p50 healthz ms", "client / encode"],
                     [[f"{med['client']:.2f}", f"{med['server_took']:.2f}", f"{med['queue']:.2f}",
                       f"{med['encode']:.2f}", f"{med['search']:.2f}", f"{med['healthz']:.2f}",
                       f"{ratio:.2f}x"]])
          + f"\nGoal (issue 7): client / encode <= 1.3x: {'yes' if ratio <= 1.3 else '**no**'}\n")
    print(md)
    writer.write(results, md)
    return 0

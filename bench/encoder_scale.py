"""``qswap bench scale``: what many LoRA encoders cost one server, in memory and in latency.

Starts a real ``qswap serve`` (its default backend: one shared ONNX Runtime session, adapters
bound per run) over the benchmark index and registers random LoRA r=32 adapters (every dense
layer, ``lora_B`` non-zero so each really changes the forward) one after another. After 1, 10,
25 and 50 encoders (``--counts``), each newly registered encoder is waited for until it runs on
the shared runtime and then used by a few searches, and the server's RSS and PSS are read from
``/proc``. Reported: RSS per count, the growth per extra encoder against the adapter's own bytes
(the server's ``memory_bytes`` and the adapter file), and RSS(50) / RSS(1).

Then, with every encoder loaded, end-to-end latency at concurrency 1 (the raw asyncio client of
``qswap.bench.loadgen``, one keep-alive connection, single-query searches, k=10): the client p50
against the server-reported encode p50, for the base and for one LoRA encoder, alternating
rounds. The ratio is what HTTP, batching and search add to the encoder's forward pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from qswap.bench.fixtures import (MODEL, index_meta, load_space_base, load_workload, lora_encoders, qswap_server,
                                  register, search_requests, stamped_index, wait_for_runtime)
from qswap.bench.load_options import LOAD_HOST, ByMode, RunDirs, warm_up
from qswap.bench.loadgen import Request, run_load_sync
from qswap.bench.plots import plot_lines
from qswap.bench.processes import http_json
from qswap.bench.results import md_table
from qswap.factors import FACTOR_NAMES

NAME = "scale"
COUNTS = ByMode((1, 10, 25, 50), (1, 3))
E2E_REQUESTS = ByMode(300, 30)
E2E_ROUNDS = ByMode(3, 1)
MIB = 2.0 ** 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench scale``."""
    p.add_argument("--counts", default=None,
                   help=f"encoder counts to measure at, comma-separated (default {COUNTS.describe()})")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank of every encoder (default 32)")
    p.add_argument("--requests", type=int, default=None,
                   help=f"searches per e2e round and encoder ({E2E_REQUESTS.describe()})")
    p.add_argument("--rounds", type=int, default=None, help=f"e2e rounds ({E2E_ROUNDS.describe()})")
    p.add_argument("--model", default=MODEL, help=f"bundled base name or model directory (default {MODEL})")
    p.add_argument("--lora-factors", choices=FACTOR_NAMES, default=None,
                   help="the server's --lora-factors (default: the server's own default, float16)")


def _counts(value: str | None, quick: bool) -> list[int]:
    if not value:
        return list(COUNTS.pick(quick))
    try:
        counts = sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"qswap: error: --counts must be integers, got {value!r}") from None
    if not counts or counts[0] < 1:
        raise SystemExit("qswap: error: --counts must be positive integers")
    return counts


def _e2e(port: int, queries: list[str], encoder: str | None, requests: int) -> dict[str, float]:
    """p50 client / server took / encode ms of ``requests`` sequential single-query searches."""
    body = {"k": 10, "with_text": False}
    if encoder:
        body["encoder"] = encoder
    reqs = [Request.post_json("/v1/search", {**body, "query": q}) for q in queries]
    res = run_load_sync(LOAD_HOST, port, reqs, concurrency=1, duration_s=600.0, max_requests=requests,
                        keep_bodies=True)
    bad = [s for s in res.samples if s.status != 200]
    if bad:
        raise SystemExit(f"qswap: error: {len(bad)} of {res.sent} searches failed (first: HTTP {bad[0].status})")
    bodies = [json.loads(s.body or b"{}") for s in res.samples]
    return {"client": statistics.median(s.latency_s * 1000 for s in res.samples),
            "took": statistics.median(b["took_ms"] for b in bodies),
            "encode": statistics.median(b["results"][0]["timings"]["encode_ms"] for b in bodies)}


def run(args: argparse.Namespace) -> int:
    """``qswap bench scale``."""
    quick = args.quick
    counts = _counts(args.counts, quick)
    n_req = args.requests or E2E_REQUESTS.pick(quick)
    rounds = args.rounds or E2E_ROUNDS.pick(quick)
    dirs = RunDirs.create(NAME, quick, args.out)
    work = load_workload(quick)
    base = load_space_base(args.model)
    idx_dir, _, _ = stamped_index(work, base, tag="default")
    names = [(f"s{i}", "1") for i in range(max(counts))]
    print(f"making {len(names)} LoRA r={args.rank} encoders (cached)", file=sys.stderr)
    root = lora_encoders(base, names, rank=args.rank, tag=f"scale{len(names)}")
    adapter_file = sum(f.stat().st_size for f in (root / f"{names[0][0]}-1").rglob("*.safetensors"))
    del base
    from qswap.factors import SERVING_FACTORS
    factors = args.lora_factors or SERVING_FACTORS
    srv = qswap_server(idx_dir, root, dirs.tmp / "state", dirs.tmp / "server.log", model=args.model,
                       extra=["--lora-factors", factors])
    res: dict[str, Any] = {"model": args.model, "rank": args.rank, "counts": counts, "workload": work.source,
                           "lora_factors": factors,
                           "index": index_meta(idx_dir), "adapter_file_bytes": adapter_file, "points": []}
    with srv:
        res["server"] = {"command": srv.command, "start_s": srv.start_seconds}
        wait_for_runtime(srv, ["base"], "onnx-shared")
        warm_up(srv.port, search_requests(work.queries, ["base"]), concurrency=2, requests=32)
        res["rss_no_encoder"], res["pss_no_encoder"] = srv.rss(), srv.pss()
        done = 0
        for count in counts:
            new = names[done:count]
            for n, v in new:
                register(srv, f"{n}-{v}")
            keys = [f"{n}@{v}" for n, v in new]
            wait_for_runtime(srv, keys, "onnx-shared")
            # Every new encoder serves a few searches before memory is read: bound and used.
            warm_up(srv.port, search_requests(work.queries, keys), concurrency=2, requests=max(16, 2 * len(keys)))
            done = count
            _, listing = http_json("GET", srv.url("/v1/encoders"))
            reported = [e.get("memory_bytes") or 0 for e in listing["encoders"] if e["key"] != "base"]
            point = {"encoders": count, "rss": srv.rss(), "pss": srv.pss(),
                     "reported_bytes_mean": sum(reported) / max(len(reported), 1)}
            res["points"].append(point)
            print(f"{count} encoders: RSS {point['rss'] / MIB:.0f} MiB", file=sys.stderr)
        lora = f"{names[0][0]}@1"
        e2e: dict[str, list[dict[str, float]]] = {"base": [], "lora": []}
        _e2e(srv.port, work.queries, lora, 40)   # warm-up, not timed
        for _ in range(rounds):
            for arm, enc in (("base", None), ("lora", lora)):
                e2e[arm].append(_e2e(srv.port, work.queries, enc, n_req))
        res["e2e"] = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for arm, rs in e2e.items()}
        res["e2e_rounds"] = e2e
    dirs.clean_scratch()
    _write(dirs, res)
    print(f"wrote {dirs.out}")
    return 0


def _write(dirs: RunDirs, res: dict[str, Any]) -> None:
    pts = res["points"]
    first, last = pts[0], pts[-1]
    span = last["encoders"] - first["encoders"]
    per_extra = (last["rss"] - first["rss"]) / span if span else float("nan")
    adapter = last["reported_bytes_mean"]
    res["per_extra_encoder_bytes"] = per_extra
    res["rss_ratio_last_over_first"] = last["rss"] / first["rss"]
    rows = [[p["encoders"], p["rss"] / MIB, (p["pss"] or 0) / MIB,
             (p["rss"] - first["rss"]) / MIB] for p in pts]
    table = md_table(["LoRA encoders", "RSS MiB", "PSS MiB", "RSS growth since the first (MiB)"], rows)
    ok1 = per_extra <= adapter + MIB
    ok2 = res["rss_ratio_last_over_first"] <= 1.25
    e = res["e2e"]
    e2e_rows = [[arm, f"{e[arm]['client']:.2f}", f"{e[arm]['took']:.2f}", f"{e[arm]['encode']:.2f}",
                 f"**{e[arm]['client'] / e[arm]['encode']:.2f}x**"] for arm in ("base", "lora")]
    ok3 = e["lora"]["client"] / e["lora"]["encode"] <= 1.3
    cmd = res["server"]["command"]
    md = (f"Server: `{cmd if isinstance(cmd, str) else ' '.join(cmd)}` (default backend: one shared ONNX Runtime session); "
          f"{res['index']['documents']:,} documents. Encoders: random LoRA r={res['rank']} adapters on every dense "
          f"layer of {res['model']}, factors stored as {res.get('lora_factors', 'float32')} (adapter file "
          f"{res['adapter_file_bytes'] / MIB:.2f} MiB in float32; the server counts "
          f"{adapter / MIB:.2f} MiB per encoder), registered over HTTP, each waited for until it runs on the "
          "shared runtime and used by searches before memory is read. Server without any encoder: RSS "
          f"{res['rss_no_encoder'] / MIB:.0f} MiB.\n\n{table}\n"
          f"- per extra encoder: **{per_extra / MIB:.2f} MiB** of RSS for {adapter / MIB:.2f} MiB of adapter "
          f"(target <= adapter + 1 MiB: {'met' if ok1 else '**missed**'})\n"
          f"- RSS with {last['encoders']} encoders / with {first['encoders']}: **{res['rss_ratio_last_over_first']:.3f}x** "
          f"(target <= 1.25x: {'met' if ok2 else '**missed**'})\n\n"
          f"### End to end at concurrency 1, {last['encoders']} encoders loaded\n\n"
          f"Median over {len(res['e2e_rounds']['base'])} alternating rounds of the per-round p50s (ms):\n\n"
          + md_table(["encoder", "client p50", "server took p50", "encode p50", "client / encode"], e2e_rows)
          + f"\nTarget: client / encode <= 1.3x with a LoRA encoder: {'met' if ok3 else '**missed**'}\n")
    plot_lines(dirs.writer.plot_path("rss.png"), [p["encoders"] for p in pts],
               {"RSS": [p["rss"] / MIB for p in pts], "PSS": [(p["pss"] or 0) / MIB for p in pts],
                "RSS(first) + n x adapter": [first["rss"] / MIB + (p["encoders"] - first["encoders"]) * adapter / MIB
                                             for p in pts]},
               xlabel="LoRA r=32 encoders registered", ylabel="MiB", title="server memory vs encoders")
    dirs.writer.write(res, md)
    print(md)

"""``qswap bench scale``: a thousand LoRA encoders in one server, in memory, latency and start time.

Starts a real ``qswap serve`` (its default backend: one shared ONNX Runtime session, adapters
bound per run) over the benchmark index, with an encoder memory budget of ``--loaded`` encoders
(below), and registers random LoRA adapters (r=16 on every dense layer, ``lora_B``
non-zero so each really changes the forward) one after another over HTTP, up to 1,000
(``--counts``). Beyond the budget the server's LRU detaches the least recently used ones, so
the newest ``--loaded`` stay attached. At every count the newest encoders are waited for until
they run on the shared runtime and the server builds nothing in the background, and the server's
RSS is read (the encoders loaded, the new ones not yet run); then every loaded encoder serves
searches (each at least once, in batches that mix them, until no build starts), and the RSS
(also by kind of page: anonymous, mapped files, shared memory) and PSS are read from ``/proc``
again and the listing is timed (whole, and one page of 100).

What must not grow with the number of encoders is measured at the largest count against the
small one (10) on two servers side by side: once the first holds the largest count, a second one
is started with 10 registered the same way, and the two are measured in turn over ``--rounds``
rounds (the order flipped every round), so that what the machine does meanwhile (other
processes, its clock, the page cache's write-back) falls on both counts alike:

- **registration**: after a ``sync`` (the store's write-back done), ``--probes`` extra encoders
  registered one at a time (each deleted again right after, so the count stays put), a share of
  them per round, p50 of the HTTP round trip;
- **search**: single-query searches at concurrency 1 (the raw asyncio client, one keep-alive
  connection, k=10) naming an encoder by its bare name (resolution to the highest version)
  and with the base, per round: client p50 and server-reported encode p50 (medians over rounds).

Finally the server is stopped and started again on the same state dir: seconds to ``/readyz``
ready with every encoder registered, and the listing paged through to check that all are back.

The memory budget is set to hold exactly ``--loaded`` encoders at what the server counts for
one (``memory_bytes`` in the listing: the adapter's tensors and the objects that hold and bind
them), read from a first server that registers one encoder and is stopped again.

Targets: registration and search p50 at the largest count within 10 % of those at 10; restart
<= 10 s to ready (issue 26). Memory (issue 32), restated from issue 26's "RSS <= 1.25x RSS(1) +
loaded x the adapter's half-precision bytes", which left out what a server holds once batches
mix encoders and what a loaded encoder costs beyond its factors:

- **RSS bound**: RSS at the largest count <= RSS(1) + the fixed per-server costs that come with
  the first batches mixing encoders (the group session and the segment session: the base's
  weights again each, :func:`~qswap.encoders.runtime.shared_adapters.session_weight_bytes`; the segment
  call buffers: :data:`~qswap.encoders.runtime.shared_segments.MAX_SEGMENTS` adapters' factors;
  with half-precision factors, the float32 copies of the factors served last, capped at
  :data:`~qswap.encoders.runtime.shared_run.WIDE_BYTES`) + loaded x the counted bytes per encoder;
- **count**: the RSS each serving encoder adds while every encoder is loaded (the slope between
  the two largest counts that are all loaded, every encoder run, the fixed costs already in both;
  the same slope before the new encoders ran is reported beside it) <= 1.10x the counted
  bytes per encoder, so the budget holds what it says; the same slope per kind of page says
  where the rest lives (an encoder's factors are anonymous memory).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from qswap.bench.fixtures import (MODEL, index_meta, load_space_base, load_workload, lora_encoders, qswap_server,
                                  register, search_requests, stamped_index, wait_for_runtime, wait_until_built,
                                  warm_until_settled)
from qswap.bench.load_options import LOAD_HOST, ByMode, RunDirs, warm_up
from qswap.bench.loadgen import Request, run_load_sync
from qswap.bench.plots import plot_lines
from qswap.bench.processes import ServerProcess, free_port, http_json
from qswap.bench.results import md_table
from qswap.factors import FACTOR_NAMES

NAME = "scale"
COUNTS = ByMode((1, 10, 100, 200, 500, 1000), (1, 10, 30))
SMALL = 10                       # the count the largest one is compared with
LOADED = ByMode(200, 10)
PROBES = ByMode(30, 4)
E2E_REQUESTS = ByMode(100, 30)
E2E_ROUNDS = ByMode(6, 1)
PAGE = 100
MIB = 2.0 ** 20
TARGET_COUNT = 1.10
# No hot encoders: the searches at 10 and at the largest count must both run on the shared graph.
# With them, the encoder searched at 10 (s0, half of the rows) ran on its own merged session;
# at 1,000 it had been evicted and loaded again, which starts its share afresh.
NO_HOT = ["--hot-encoders", "0"]
TARGET_SAME = 1.10
# Serving every loaded encoder before a reading: at least this many searches, on this many
# connections (so batches mix encoders and the runtimes built for mixed batches are in from the start).
SERVE_MIN = 16
SERVE_CONCURRENCY = 4
TARGET_RESTART_S = 10.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench scale``."""
    p.add_argument("--counts", default=None,
                   help=f"encoder counts to measure at, comma-separated, {SMALL} among them "
                        f"(default {COUNTS.describe()})")
    p.add_argument("--loaded", type=int, default=None,
                   help=f"encoders the memory budget holds loaded ({LOADED.describe()})")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of every encoder (default 16)")
    p.add_argument("--probes", type=int, default=None,
                   help=f"registrations timed at {SMALL} and at the largest count ({PROBES.describe()})")
    p.add_argument("--requests", type=int, default=None,
                   help=f"searches per round and arm ({E2E_REQUESTS.describe()})")
    p.add_argument("--rounds", type=int, default=None, help=f"search rounds ({E2E_ROUNDS.describe()})")
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
    if not counts or counts[0] < 1 or SMALL not in counts or counts[-1] <= SMALL:
        raise SystemExit(f"qswap: error: --counts must be positive integers with {SMALL} and a larger one")
    return counts


def _half_bytes(enc_dir: Path) -> int:
    """Bytes of the adapter's tensors at half precision (2 bytes per element)."""
    from safetensors import safe_open
    n = 0
    for f in enc_dir.rglob("*.safetensors"):
        with safe_open(str(f), framework="np") as st:
            for name in st.keys():
                size = 1
                for d in st.get_slice(name).get_shape():
                    size *= d
                n += size
    return 2 * n


def _fixed_bytes(base: Any, half: int, factors: str) -> dict[str, int]:
    """What a server holds once its batches mix encoders, whatever the number of encoders: two
    more sessions of the shared graph's weights (the single-threaded group session and the
    segment session), the segment call buffers (MAX_SEGMENTS adapters' factors) and, with
    half-precision factors, the capped float32 copies of the factors served last (WIDE_BYTES)."""
    from qswap.encoders.runtime.shared_adapters import session_weight_bytes
    from qswap.encoders.runtime.shared_run import WIDE_BYTES
    from qswap.encoders.runtime.shared_segments import MAX_SEGMENTS
    fixed = {"group_session": session_weight_bytes(base), "segment_session": session_weight_bytes(base),
             "segment_buffers": MAX_SEGMENTS * half}
    if factors != "float32":
        fixed["float32_factor_copies"] = WIDE_BYTES
    return fixed


def _counted_bytes(idx_dir: Path, root: Path, dirs: RunDirs, model: str, factors: str, rel: str) -> int:
    """The bytes a server counts for one loaded encoder of the run (all are alike): a first
    server registers one, serves it on the shared graph, reports its count and stops."""
    srv = qswap_server(idx_dir, root, dirs.tmp / "state-count", dirs.tmp / "count.log", model=model,
                       extra=["--lora-factors", factors, *NO_HOT])
    with srv:
        body, _ = register(srv, rel)
        key = body["encoder"]["key"]
        wait_for_runtime(srv, [key], "onnx-shared")
        got, _ = _timed_get(srv, f"/v1/encoders/{key}")
    if not got.get("memory_bytes"):
        raise SystemExit(f"qswap: error: the server counts no bytes for loaded encoder {key}: {got}")
    return int(got["memory_bytes"])


def _e2e(port: int, queries: list[str], encoder: str | None, requests: int) -> dict[str, float]:
    """p50 client / server took / encode ms of ``requests`` sequential single-query searches."""
    body: dict[str, Any] = {"k": 10, "with_text": False}
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


def _timed_get(srv: ServerProcess, path: str) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    status, body = http_json("GET", srv.url(path))
    dt = time.perf_counter() - t0
    if status != 200:
        raise SystemExit(f"qswap: error: GET {path} answered {status}: {body}")
    return body, dt


def _all_pages(srv: ServerProcess, limit: int) -> list[dict[str, Any]]:
    """Every encoder, read ``limit`` at a time through the listing's cursor."""
    out: list[dict[str, Any]] = []
    after = None
    while True:
        body, _ = _timed_get(srv, f"/v1/encoders?limit={limit}" + (f"&after={after}" if after else ""))
        out += body["encoders"]
        after = body.get("next")
        if not after:
            return out


def _probe(srv: ServerProcess, probes: list[str]) -> list[float]:
    """Seconds to register each probe encoder (each is deleted again at once)."""
    times = []
    for rel in probes:
        body, dt = register(srv, rel)
        times.append(dt)
        key = body["encoder"]["key"]
        status, answer = http_json("DELETE", srv.url(f"/v1/encoders/{key}"))
        if status != 200:
            raise SystemExit(f"qswap: error: DELETE {key} answered {status}: {answer}")
    return times


def _grow(srv: ServerProcess, names: list[tuple[str, str]], done: int, count: int, loaded: int) -> list[float]:
    """Register ``names[done:count]`` one by one (seconds each, returned), then wait until the newest
    run on the shared graph and the server builds nothing in the background (a graph being built
    holds transient memory that an RSS reading would take for the encoders')."""
    t0 = time.perf_counter()
    took = []
    for i, (n, v) in enumerate(names[done:count]):
        _, dt = register(srv, f"{n}-{v}")
        took.append(dt)
        if (done + i + 1) % 100 == 0:
            print(f"  {done + i + 1} registered ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    fresh = [f"{n}@{v}" for n, v in names[done:count]][-loaded:]
    wait_for_runtime(srv, fresh, "onnx-shared")
    wait_until_built(srv)
    return took


def _serve_loaded(srv: ServerProcess, work: Any, names: list[tuple[str, str]], count: int, loaded: int) -> int:
    """Run every loaded encoder (the newest ``loaded`` of the first ``count``: those the budget keeps)
    through searches, each at least once, with batches that mix them, until the server builds nothing
    more in the background; returns the searches sent. What an encoder holds once it serves (its
    bindings, the float32 copy of its factors) is only there after it ran."""
    newest = [f"{n}@{v}" for n, v in names[max(0, count - min(loaded, count)):count]]
    requests = max(SERVE_MIN, len(newest))
    got = warm_until_settled(srv, search_requests(work.queries, newest), concurrency=SERVE_CONCURRENCY,
                             requests=requests)
    return got["rounds"] * requests


def _memory(srv: ServerProcess) -> dict[str, Any]:
    """The server's RSS, PSS and RSS by kind of page now (``/proc``)."""
    return {"rss": srv.rss(), "pss": srv.pss(), "rss_parts": srv.rss_parts()}


def _proc_counters(srv: ServerProcess) -> dict[str, float]:
    """The server's minor page faults and CPU seconds so far (``/proc``)."""
    assert srv.proc is not None
    stat = Path(f"/proc/{srv.proc.pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return {"minor_faults": float(fields[7]), "cpu_s": (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")}


def _gc_counts(srv: ServerProcess) -> dict[str, float]:
    """The server's garbage collections so far, by generation (``/metrics``)."""
    with urllib.request.urlopen(srv.url("/metrics"), timeout=30) as r:
        text = r.read().decode()
    return {f"gc{m.group(1)}": float(m.group(2))
            for m in re.finditer(r'python_gc_collections_total\{generation="(\d)"\} (\S+)', text)}


def _search_round(srv: ServerProcess, queries: list[str], lora_name: str,
                  requests: int) -> dict[str, dict[str, float]]:
    """One round of each search arm (base, then by encoder name), with what each cost the server
    per search besides its latency: CPU, minor page faults, garbage collections.

    The ``/proc`` readings bracket the searches alone. The collections are read from ``/metrics``,
    whose rendering costs work of its own that grows with the registry (a few label sets per
    encoder: ~300 KiB, 50-70 ms of CPU and dozens of young collections at 1,000 encoders), so one
    scrape's own collections, read by a second scrape right after, are taken off."""
    out = {}
    for arm, enc in (("base", None), ("lora", lora_name)):
        gc0 = _gc_counts(srv)
        before = _proc_counters(srv)
        out[arm] = _e2e(srv.port, queries, enc, requests)
        after = _proc_counters(srv)
        gc1 = _gc_counts(srv)
        scrape = _proc_counters(srv)
        gc2 = _gc_counts(srv)
        out[arm]["metrics_scrape_cpu_s"] = _proc_counters(srv)["cpu_s"] - scrape["cpu_s"]
        out[arm].update({f"{k}_per_search": (after[k] - before[k]) / requests for k in before})
        out[arm].update({f"{k}_per_search": max(0.0, (gc1[k] - gc0[k]) - (gc2[k] - gc1[k])) / requests
                         for k in gc0})
    return out


def _side_by_side(servers: dict[int, ServerProcess], work: Any, probes: list[str], n_req: int,
                  rounds: int) -> dict[int, dict[str, Any]]:
    """What must not grow with the encoder count, on two servers at once (``{count: server}``),
    measured in alternating rounds (the order flips every round), so that what the machine does
    meanwhile (other processes, clock, page-cache write-back) falls on both counts alike.

    Per round and server: the page cache is flushed (``sync``: each registration writes the
    encoder's files, ~5 MB, into the server's store, and right after a thousand of them the kernel
    throttles writers while it writes back gigabytes; that is the disk's backlog, not what a
    registration costs at that count), a share of the probe registrations (each deleted again at
    once, so the count stays put), then a round of each search arm."""
    out: dict[int, dict[str, Any]] = {c: {"sync_s": [], "registration_s": [], "rounds": {"base": [], "lora": []}}
                                      for c in servers}
    for srv in servers.values():
        _e2e(srv.port, work.queries, "s0", 40)   # warm-up (and a reload if it was evicted), not timed
    share = -(-len(probes) // rounds)
    for r in range(rounds):
        order = list(servers) if r % 2 == 0 else list(servers)[::-1]
        for count in order:
            srv, o = servers[count], out[count]
            t0 = time.perf_counter()
            os.sync()
            o["sync_s"].append(time.perf_counter() - t0)
            o["registration_s"] += _probe(srv, probes[r * share:(r + 1) * share])
            for arm, v in _search_round(srv, work.queries, "s0", n_req).items():
                o["rounds"][arm].append(v)
    for o in out.values():
        o["registration_p50_ms"] = statistics.median(o["registration_s"]) * 1000
        o["search"] = {"p50": {arm: {k: statistics.median(r[k] for r in v) for k in v[0]}
                               for arm, v in o["rounds"].items()}, "rounds": o.pop("rounds")}
    return out


def run(args: argparse.Namespace) -> int:
    """``qswap bench scale``."""
    quick = args.quick
    counts = _counts(args.counts, quick)
    loaded = args.loaded or LOADED.pick(quick)
    n_probes = args.probes or PROBES.pick(quick)
    n_req = args.requests or E2E_REQUESTS.pick(quick)
    rounds = args.rounds or E2E_ROUNDS.pick(quick)
    dirs = RunDirs.create(NAME, quick, args.out)
    work = load_workload(quick)
    base = load_space_base(args.model)
    idx_dir, _, _ = stamped_index(work, base, tag="default")
    names = [(f"s{i}", "1") for i in range(counts[-1])]
    probe_names = [(f"p{i}", "1") for i in range(n_probes)]
    print(f"making {len(names) + len(probe_names)} LoRA r={args.rank} encoders (cached)", file=sys.stderr)
    t0 = time.perf_counter()
    root = lora_encoders(base, names + probe_names, rank=args.rank, tag="scale")   # one cache for every count
    print(f"  ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    first_dir = root / f"{names[0][0]}-1"
    adapter_file = sum(f.stat().st_size for f in first_dir.rglob("*.safetensors"))
    half = _half_bytes(first_dir)
    from qswap.factors import SERVING_FACTORS
    factors = args.lora_factors or SERVING_FACTORS
    fixed = _fixed_bytes(base, half, factors)
    del base
    counted = _counted_bytes(idx_dir, root, dirs, args.model, factors, f"{names[0][0]}-{names[0][1]}")
    budget_mib = -(-loaded * counted // int(MIB))   # room for ``loaded`` encoders (less than one more: 1 MiB < counted)
    budget = budget_mib * int(MIB)
    srv = qswap_server(idx_dir, root, dirs.tmp / "state", dirs.tmp / "server.log", model=args.model,
                       extra=["--lora-factors", factors, "--encoder-memory-mb", str(budget_mib), *NO_HOT])
    res: dict[str, Any] = {"model": args.model, "rank": args.rank, "counts": counts, "loaded_target": loaded,
                           "workload": work.source, "lora_factors": factors, "index": index_meta(idx_dir),
                           "adapter_file_bytes": adapter_file, "adapter_half_bytes": half,
                           "counted_bytes": counted, "fixed_bytes": fixed,
                           "memory_budget_bytes": budget, "requests": n_req, "points": [], "registration_s": []}
    with srv:
        res["server"] = {"command": srv.command, "start_s": srv.start_seconds}
        wait_for_runtime(srv, ["base"], "onnx-shared")
        warm_up(srv.port, search_requests(work.queries, ["base"]), concurrency=2, requests=32)
        res["rss_no_encoder"], res["pss_no_encoder"] = srv.rss(), srv.pss()
        done = 0
        for count in counts:
            res["registration_s"] += _grow(srv, names, done, count, loaded)
            done = count
            # Twice: loaded only (registered, attached, bound to the shared graph), then serving.
            before = _memory(srv)
            served = _serve_loaded(srv, work, names, count, loaded)
            listing, list_s = _timed_get(srv, "/v1/encoders")
            _, page_s = _timed_get(srv, f"/v1/encoders?limit={PAGE}&after=s5")
            point = {"encoders": count, **_memory(srv), "loaded_only": before, "searches_served": served,
                     "loaded": sum(1 for e in listing["encoders"] if e["key"] != "base" and e["loaded"]),
                     "list_all_ms": list_s * 1000, "list_page_ms": page_s * 1000,
                     "list_all_bytes": len(json.dumps(listing))}
            reported = [e["memory_bytes"] for e in listing["encoders"] if e["key"] != "base" and e["loaded"]]
            point["reported_bytes_mean"] = sum(reported) / max(len(reported), 1)
            res["points"].append(point)
            print(f"{count} encoders: RSS {point['rss'] / MIB:.0f} MiB serving, {before['rss'] / MIB:.0f} MiB "
                  f"loaded only, {point['loaded']} loaded, listing {point['list_all_ms']:.0f} ms", file=sys.stderr)
        # The smallest count on a second server of its own, beside this one: both measured in turn.
        small = qswap_server(idx_dir, root, dirs.tmp / "state-small", dirs.tmp / "small.log", model=args.model,
                             extra=["--lora-factors", factors, "--encoder-memory-mb", str(budget_mib), *NO_HOT])
        with small:
            wait_for_runtime(small, ["base"], "onnx-shared")
            warm_up(small.port, search_requests(work.queries, ["base"]), concurrency=2, requests=32)
            _grow(small, names, 0, SMALL, loaded)
            _serve_loaded(small, work, names, SMALL, loaded)
            res["side_by_side"] = {str(c): v for c, v in _side_by_side(
                {SMALL: small, counts[-1]: srv}, work, [f"{n}-{v}" for n, v in probe_names], n_req, rounds).items()}
        res["points"][-1]["rss_after_probes"] = srv.rss()
    # Restart on the same state dir with every encoder registered: seconds to ready.
    cmd = list(srv.cmd)
    port = free_port()
    cmd[cmd.index("--port") + 1] = str(port)
    again = ServerProcess(cmd, port, ready_path="/readyz", log_path=dirs.tmp / "restart.log")
    with again:
        listed = _all_pages(again, 250)
        back = _e2e(again.port, work.queries, "s0", 20)
        res["restart"] = {"start_s": again.start_seconds, "listed": len(listed) - 1, "rss": again.rss(),
                          "first_search_p50_ms": back["client"]}
    print(f"restart with {counts[-1]} registered: ready in {again.start_seconds:.2f} s", file=sys.stderr)
    dirs.clean_scratch()
    _write(dirs, res)
    print(f"wrote {dirs.out}")
    return 0


def _slope(a: dict[str, Any], b: dict[str, Any], n: int) -> tuple[float, dict[str, float]]:
    """RSS per encoder from reading ``a`` to reading ``b`` (``n`` encoders apart), and the same per kind
    of page. Anonymous memory is what the encoders hold; file pages (mapped libraries and weights)
    come and go with the page cache, not with the count."""
    return (b["rss"] - a["rss"]) / n, {k: (v - a.get("rss_parts", {}).get(k, 0)) / n
                                       for k, v in b.get("rss_parts", {}).items()}


def _parts(parts: dict[str, float]) -> str:
    return (" (by kind of page: " + ", ".join(f"{k} {v / MIB:.2f} MiB" for k, v in parts.items()) + ")"
            if parts else "")


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _write(dirs: RunDirs, res: dict[str, Any]) -> None:
    pts = res["points"]
    first, last = pts[0], pts[-1]
    half, loaded = res["adapter_half_bytes"], res["loaded_target"]
    counted, fixed = res["counted_bytes"], sum(res["fixed_bytes"].values())
    rss_target = first["rss"] + fixed + last["loaded"] * counted
    # Per encoder, where every encoder is loaded and the fixed costs are in: the two largest such counts.
    full = [p for p in pts if p["encoders"] == p["loaded"] and p["encoders"] >= SMALL][-2:]
    slope, slope_parts, slope_idle, slope_idle_parts = None, {}, None, {}
    if len(full) == 2:
        n = full[1]["encoders"] - full[0]["encoders"]
        slope, slope_parts = _slope(full[0], full[1], n)   # serving: every encoder ran at both
        if "loaded_only" in full[1]:   # the new ones loaded, not yet run, over the last reading
            slope_idle, slope_idle_parts = _slope(full[0], full[1]["loaded_only"], n)
    s_small, s_last = res["side_by_side"][str(SMALL)], res["side_by_side"][str(last["encoders"])]
    reg_ratio = s_last["registration_p50_ms"] / s_small["registration_p50_ms"]
    search_ratio = {arm: s_last["search"]["p50"][arm]["client"] / s_small["search"]["p50"][arm]["client"]
                    for arm in ("base", "lora")}
    restart = res["restart"]
    res["summary"] = {"rss_target_bytes": rss_target, "rss_last_bytes": last["rss"],
                      "rss_ok": last["rss"] <= rss_target, "rss_per_loaded_encoder_bytes": slope,
                      "rss_per_loaded_encoder_parts_bytes": slope_parts,
                      "rss_per_loaded_encoder_not_run_bytes": slope_idle,
                      "rss_per_loaded_encoder_not_run_parts_bytes": slope_idle_parts,
                      "count_ratio": slope / counted if slope is not None else None,
                      "count_ok": slope is not None and slope <= TARGET_COUNT * counted, "registration_p50_ratio": reg_ratio,
                      "registration_ok": reg_ratio <= TARGET_SAME, "search_p50_ratio": search_ratio,
                      "search_ok": search_ratio["lora"] <= TARGET_SAME,
                      "restart_s": restart["start_s"], "restart_ok": restart["start_s"] <= TARGET_RESTART_S}
    sm = res["summary"]
    rows = [[p["encoders"], p["loaded"], p["rss"] / MIB, (p["pss"] or 0) / MIB, (p["rss"] - first["rss"]) / MIB,
             p["loaded_only"]["rss"] / MIB if "loaded_only" in p else "-",
             p["list_all_ms"], p["list_page_ms"], p["list_all_bytes"] / 1024] for p in pts]
    table = md_table(["LoRA encoders registered", "loaded", "RSS MiB (serving)", "PSS MiB", "RSS growth since 1 (MiB)",
                      "RSS MiB before the new ones ran", "GET /v1/encoders ms (all)", f"ms (page of {PAGE})",
                      "listing KiB"], rows)
    same_rows = [["registration (HTTP, p50 ms)", f"{s_small['registration_p50_ms']:.1f}",
                  f"{s_last['registration_p50_ms']:.1f}", f"**{reg_ratio:.3f}x**"]]
    for arm, label in (("lora", "search by encoder name, client p50 ms"), ("base", "search with the base, client p50 ms")):
        a, b = s_small["search"]["p50"][arm], s_last["search"]["p50"][arm]
        same_rows.append([label, f"{a['client']:.2f}", f"{b['client']:.2f}", f"**{search_ratio[arm]:.3f}x**"])
        same_rows.append(["  (server encode p50 ms)", f"{a['encode']:.2f}", f"{b['encode']:.2f}",
                          f"{b['encode'] / a['encode']:.3f}x"])
        for key, what, scale in (("cpu_s_per_search", "server CPU ms per search", 1000.0),
                                 ("minor_faults_per_search", "server minor page faults per search", 1.0),
                                 ("gc0_per_search", "server young-generation GCs per search", 1.0)):
            if key in a and key in b:
                same_rows.append([f"  ({what})", f"{a[key] * scale:.3g}", f"{b[key] * scale:.3g}",
                                  f"{b[key] / a[key]:.3f}x" if a[key] else "-"])
    a, b = s_small["search"]["p50"]["base"], s_last["search"]["p50"]["base"]
    if "metrics_scrape_cpu_s" in a:   # 10 ms resolution (clock ticks): a median over the rounds
        same_rows.append(["GET /metrics, server CPU ms per scrape", f"{a['metrics_scrape_cpu_s'] * 1000:.0f}",
                          f"{b['metrics_scrape_cpu_s'] * 1000:.0f}", "-"])
    cmd = res["server"]["command"]
    reg = res["registration_s"]
    fixed_parts = ", ".join(f"{k.replace('_', ' ')} {v / MIB:.0f}" for k, v in res["fixed_bytes"].items())
    slope_span = (f"RSS({full[1]['encoders']}) - RSS({full[0]['encoders']}), all loaded, over "
                  f"{full[1]['encoders'] - full[0]['encoders']}") if len(full) == 2 else "no two all-loaded counts"
    # Only where two all-loaded counts exist (a run with fewer has no slope to report).
    idle_line = (f"- the same encoders before they ran (registered, attached and bound to the shared graph, never "
                 f"searched; RSS({full[1]['encoders']}) before its new encoders ran - RSS({full[0]['encoders']})): "
                 f"{slope_idle / MIB:.2f} MiB" + _parts(slope_idle_parts) + "\n") if slope_idle is not None else ""
    md = (f"Server: `{cmd if isinstance(cmd, str) else ' '.join(cmd)}` (default backend: one shared ONNX Runtime "
          f"session); {res['index']['documents']:,} documents. Encoders: random LoRA r={res['rank']} adapters on "
          f"every dense layer of {res['model']} (adapter file {res['adapter_file_bytes'] / MIB:.2f} MiB in float32, "
          f"{half / MIB:.2f} MiB at half precision; the server stores factors as {res['lora_factors']} and counts "
          f"{last['reported_bytes_mean'] / MIB:.2f} MiB per loaded encoder: factors and the objects that hold and "
          f"bind them), registered one by one over HTTP; memory budget {res['memory_budget_bytes'] / MIB:.0f} MiB = "
          f"{loaded} encoders at {counted / MIB:.2f} MiB counted (the LRU keeps the newest loaded). Server without any encoder: RSS {res['rss_no_encoder'] / MIB:.0f} MiB; start "
          f"{res['server']['start_s']:.2f} s.\n\n{table}\n"
          f"All {len(reg)} registrations: p50 {statistics.median(reg) * 1000:.1f} ms, max "
          f"{max(reg) * 1000:.0f} ms.\n\n"
          f"### Targets\n\n"
          f"The memory bound is what a server holds with one encoder, plus what comes once its batches mix "
          f"encoders (two more sessions of the base's weights, the segment call's buffers, the capped float32 "
          f"copies of half-precision factors: fixed, whatever the number of encoders), plus what the budget counts for each loaded encoder; the count is checked "
          f"against the RSS each loaded encoder adds (`qswap bench encoder-memory` checks it in one process).\n\n"
          f"- RSS with {last['encoders']} registered, {last['loaded']} loaded: **{last['rss'] / MIB:.0f} MiB** <= "
          f"RSS(1) {first['rss'] / MIB:.0f} MiB + fixed {fixed / MIB:.0f} MiB ({fixed_parts}) + {last['loaded']} x "
          f"{counted / MIB:.2f} MiB counted = {rss_target / MIB:.0f} MiB: {_verdict(sm['rss_ok'])}\n"
          f"- RSS per serving encoder ({slope_span}; every loaded encoder searched before each reading): "
          f"**{(slope or 0) / MIB:.2f} MiB** <= {TARGET_COUNT:.2f}x the "
          f"{counted / MIB:.2f} MiB counted: {_verdict(sm['count_ok'])} ({(sm['count_ratio'] or 0):.2f}x)"
          + _parts(slope_parts) + "\n"
          + idle_line +
          f"- restart with {last['encoders']} registered: **{restart['start_s']:.2f} s** to ready (first start "
          f"with none: {res['server']['start_s']:.2f} s; {restart['listed']} encoders listed after it, paged 250 "
          f"at a time; first searches on an encoder loaded lazily: p50 {restart['first_search_p50_ms']:.1f} ms) "
          f"<= {TARGET_RESTART_S:.0f} s: {_verdict(sm['restart_ok'])}\n"
          f"- at {last['encoders']} registered against {SMALL} (a second server with {SMALL} registered, started "
          f"beside the first once that one holds {last['encoders']}; the two measured in turn, "
          f"{len(s_last['search']['rounds']['lora'])} rounds, the order flipped every round; registration: "
          f"{len(s_last['registration_s'])} probes each, each deleted after, once the page cache is flushed "
          f"(`sync`: max {max(s_small['sync_s']):.1f} s at {SMALL}, {max(s_last['sync_s']):.1f} s at "
          f"{last['encoders']}; each registration writes the encoder's files into the server's store); search: "
          f"median of the rounds' p50s of {res.get('requests', '')} single-query searches at concurrency 1; the "
          f"server's CPU and page faults read from `/proc` around the searches alone, its collections from "
          f"`/metrics` less one scrape's own), target <= "
          f"{TARGET_SAME:.2f}x: registration {_verdict(sm['registration_ok'])}, search "
          f"{_verdict(sm['search_ok'])}\n\n"
          + md_table(["", f"at {SMALL}", f"at {last['encoders']}", "ratio"], same_rows))
    xs = [p["encoders"] for p in pts]
    plot_lines(dirs.writer.plot_path("rss.png"), xs,
               {"RSS": [p["rss"] / MIB for p in pts], "PSS": [(p["pss"] or 0) / MIB for p in pts],
                "bound: RSS(1) + fixed + loaded x counted":
                    [(first["rss"] + fixed + p["loaded"] * counted) / MIB for p in pts]},
               xlabel=f"LoRA r={res['rank']} encoders registered (at most {loaded} loaded)", ylabel="MiB",
               title="server memory vs encoders registered", logx=True)
    window = max(1, min(50, len(reg) // 5))
    mids = list(range(window, len(reg) + 1, window))
    plot_lines(dirs.writer.plot_path("registration.png"), mids,
               {f"p50 of each {window} registrations": [statistics.median(reg[m - window:m]) * 1000 for m in mids]},
               xlabel="encoders registered", ylabel="ms per registration (HTTP)",
               title="registration time vs encoders registered")
    dirs.writer.write(res, md)
    print(md)

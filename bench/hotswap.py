"""Hot-swap benchmark: encoder versions replaced under load, and what the traffic sees.

``qswap serve`` runs as a child process (same index and model as ``qswap bench serving``).
A closed-loop load (:mod:`qswap.bench.loadgen`) sends every query through the domain alias
``live`` while this process, ``--swaps`` times:

1. registers a new version ``live@N`` (``POST /v1/encoders``: copy, verify, attach);
2. sends one search naming ``live@N`` directly (registration-to-first-served time);
3. points the alias at it (``PUT /v1/aliases/live``);
4. waits until the load's own responses report ``live@N`` (alias-to-traffic time);
5. deletes ``live@N-1`` (``DELETE /v1/encoders/...``, which waits for its in-flight requests).

Every load response is checked: status 200 and an encoder key that was live at some point
during the request. The acceptance bar is zero failed requests.
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from typing import Any

from qswap.bench.load_options import LOAD_HOST, ByMode, RunDirs, add_model_argument, warm_up
from qswap.bench.results import ResultWriter, md_table
from qswap.bench.processes import http_json
from qswap.bench.plots import plot_lines
from qswap.bench.stats import summarize
from qswap.bench.loadgen import Request, Sample, run_load_sync, throughput_over_time
from qswap.bench.fixtures import MODEL, index_meta, load_space_base, load_workload, lora_encoders, qswap_server, register, stamped_index
from qswap.errors import InvalidInputError

NAME = "hotswap"
DOMAIN = "live"
_KEY = re.compile(rb'"key":\s*"([^"]+)"')
# Defaults for a full run and for --quick.
SWAPS = ByMode(20, 3)
CONCURRENCY = ByMode(8, 2)
PAUSE = ByMode(1.0, 0.3)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench hotswap``."""
    p.add_argument("--swaps", type=int, default=None, help=f"versions swapped in ({SWAPS.describe()})")
    # One level, not a sweep: the load runs for the whole swap sequence.
    p.add_argument("--concurrency", type=int, default=None, help=f"load connections ({CONCURRENCY.describe()})")
    p.add_argument("--pause", type=float, default=None,
                   help=f"seconds of plain load between swaps ({PAUSE.describe()})")
    add_model_argument(p, MODEL)


class _Tracker:
    """Watches load responses: when each encoder key was first served, and bad responses."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.first_seen: dict[str, float] = {}
        self.bad: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def __call__(self, s: Sample) -> None:
        key = None
        if s.body is not None:
            m = _KEY.search(s.body)
            key = m.group(1).decode() if m else None
        now = time.perf_counter()
        with self.lock:
            if 200 <= s.status < 300 and key:
                self.first_seen.setdefault(key, now)
            elif len(self.bad) < 50:
                self.bad.append({"index": s.index, "status": s.status, "error": s.error,
                                 "at_s": s.start_s, "body": (s.body or b"")[:300].decode("utf-8", "replace")})
            s.body = None   # keep memory flat over a long run

    def wait_for(self, key: str, timeout_s: float) -> float | None:
        end = time.perf_counter() + timeout_s
        while time.perf_counter() < end:
            with self.lock:
                if key in self.first_seen:
                    return self.first_seen[key]
            time.sleep(0.002)
        return None


def run(args: argparse.Namespace) -> int:
    """``qswap bench hotswap``."""
    quick = bool(args.quick)
    swaps = args.swaps or SWAPS.pick(quick)
    conc = args.concurrency or CONCURRENCY.pick(quick)
    pause = args.pause if args.pause is not None else PAUSE.pick(quick)
    if swaps < 1:
        raise InvalidInputError(f"--swaps must be >= 1, got {swaps}", "e.g. --swaps 20")
    dirs = RunDirs.create(NAME, quick, args.out)
    tmp = dirs.tmp

    work = load_workload(quick)
    base = load_space_base(args.model)
    idx_dir, _, _ = stamped_index(work, base, tag="default")
    versions = [(DOMAIN, str(v)) for v in range(1, swaps + 2)]
    enc_root = lora_encoders(base, versions, tag=f"live{swaps + 1}")
    del base
    srv = qswap_server(idx_dir, enc_root, tmp / "state", tmp / "server.log", model=args.model)
    swaps_out: list[dict[str, Any]] = []
    res: dict[str, Any] = {"workload": work.source, "index": index_meta(idx_dir), "swaps": swaps,
                           "concurrency": conc, "pause_s": pause,
                           "encoders": "random LoRA adapters (rank 32, all dense layers), one version per swap"}
    with srv:
        res["server"] = {"command": srv.command, "start_s": srv.start_seconds}
        register(srv, f"{DOMAIN}-1")
        st, body = http_json("PUT", srv.url(f"/v1/aliases/{DOMAIN}"), {"encoder": f"{DOMAIN}@1"})
        if st != 200:
            raise InvalidInputError(f"setting alias {DOMAIN} failed ({st}): {body}", "see the server log")
        reqs = [Request.post_json("/v1/search", {"query": q, "domain": DOMAIN, "k": 10}) for q in work.queries]
        warm_up(srv.port, reqs, concurrency=conc, requests=4 * conc, duration_s=30)

        stop = threading.Event()
        t0 = time.perf_counter()
        tracker = _Tracker(t0)
        holder: dict[str, Any] = {}
        budget_s = 60.0 + swaps * (pause + 30.0)

        def load() -> None:
            holder["result"] = run_load_sync(LOAD_HOST, srv.port, reqs, concurrency=conc, max_requests=10**7,
                                             duration_s=budget_s, keep_bodies=True, on_response=tracker,
                                             should_stop=stop.is_set)
        th = threading.Thread(target=load, name="load", daemon=True)
        th.start()
        try:
            time.sleep(pause)
            for v in range(2, swaps + 2):
                key, old = f"{DOMAIN}@{v}", f"{DOMAIN}@{v - 1}"
                rec: dict[str, Any] = {"version": key}
                t_reg = time.perf_counter()
                _, rec["register_s"] = register(srv, f"{DOMAIN}-{v}")
                st, body = http_json("POST", srv.url("/v1/search"), {"query": work.queries[v % len(work.queries)],
                                                                     "encoder": key, "k": 10})
                t_first = time.perf_counter()
                served = st == 200 and body["results"][0]["encoder"]["key"] == key
                rec["direct_first_served_s"] = t_first - t_reg if served else None
                t_a = time.perf_counter()
                st, body = http_json("PUT", srv.url(f"/v1/aliases/{DOMAIN}"), {"encoder": key})
                rec["alias_s"] = time.perf_counter() - t_a
                rec["alias_ok"] = st == 200
                seen = tracker.wait_for(key, 30.0)
                rec["alias_to_traffic_s"] = seen - t_a if seen else None
                rec["register_to_traffic_s"] = seen - t_reg if seen else None
                t_d = time.perf_counter()
                st, body = http_json("DELETE", srv.url(f"/v1/encoders/{old}"))
                rec["delete_s"] = time.perf_counter() - t_d
                rec["delete_ok"] = st == 200
                rec["at_s"] = t_reg - t0
                swaps_out.append(rec)
                print(f"swap {v - 1}/{swaps}: register {rec['register_s'] * 1e3:.0f} ms, first served "
                      f"{(rec['direct_first_served_s'] or float('nan')) * 1e3:.0f} ms, traffic "
                      f"{(rec['register_to_traffic_s'] or float('nan')) * 1e3:.0f} ms", file=sys.stderr)
                time.sleep(pause)
        finally:
            stop.set()
            th.join(budget_s + 60)
        load_res = holder["result"]
        res["server"]["rss_bytes_end"] = srv.rss()
        st, enc_list = http_json("GET", srv.url("/v1/encoders"))
        res["encoders_left"] = [e["key"] for e in enc_list.get("encoders", [])] if st == 200 else None

    res["load"] = load_res.summary()
    res["failed_requests"] = load_res.failed + len([b for b in tracker.bad if b["status"] == 200])
    res["bad_samples"] = tracker.bad
    res["swap_records"] = swaps_out
    res["admin_failures"] = sum(1 for r in swaps_out if not (r["alias_ok"] and r["delete_ok"]
                                                               and r["direct_first_served_s"] is not None
                                                               and r["register_to_traffic_s"] is not None))
    for f in ("register_s", "direct_first_served_s", "alias_s", "alias_to_traffic_s", "register_to_traffic_s",
              "delete_s"):
        vals = [r[f] * 1e3 for r in swaps_out if r.get(f) is not None]
        res[f[:-2] + "_ms"] = summarize(vals)
    _write(dirs.writer, res, load_res, swaps_out)
    dirs.clean_scratch()
    print(f"wrote {dirs.out}: {res['failed_requests']} failed of {load_res.sent} requests during {swaps} swaps")
    return 0 if res["failed_requests"] == 0 and res["admin_failures"] == 0 else 1


def _write(w: ResultWriter, res: dict[str, Any], load_res: Any, swaps: list[dict[str, Any]]) -> None:
    tp = throughput_over_time(load_res, 0.5)
    xs = [i * tp.window_s for i in range(len(tp.counts))]
    plot_lines(w.plot_path("load_during_swaps.png"), xs,
               {"ok / s": [c / tp.window_s for c in tp.counts], "failed / s": [f / tp.window_s for f in tp.failures]},
               xlabel="seconds since load start", ylabel="requests / s",
               title=f"Load through alias '{DOMAIN}' during {len(swaps)} swaps",
               vlines=[r["at_s"] for r in swaps], vlabel="registration of a new version")
    ns = list(range(1, len(swaps) + 1))
    plot_lines(w.plot_path("swap_times.png"), ns,
               {"register (POST)": [r["register_s"] * 1e3 for r in swaps],
                "register -> first served (direct)": [(r["direct_first_served_s"] or float("nan")) * 1e3 for r in swaps],
                "register -> first served (traffic via alias)": [(r["register_to_traffic_s"] or float("nan")) * 1e3
                                                                 for r in swaps],
                "delete old (drains in-flight)": [r["delete_s"] * 1e3 for r in swaps]},
               xlabel="swap", ylabel="ms", title="Time per swap under load")
    L = res["load"]
    rows = [[label, res[key]["p50"], res[key]["p95"], res[key]["max"]]
            for label, key in (("register (POST /v1/encoders)", "register_ms"),
                               ("registration -> first served request naming it", "direct_first_served_ms"),
                               ("alias switch (PUT /v1/aliases)", "alias_ms"),
                               ("alias switch -> first load response from it", "alias_to_traffic_ms"),
                               ("registration -> first load response from it", "register_to_traffic_ms"),
                               ("delete previous version (waits for in-flight)", "delete_ms"))]
    md = (f"Workload: {res['workload']}; index {res['index']['documents']:,} documents (synthetic vectors in the "
          f"model's space, as in `qswap bench serving`). Encoders: {res['encoders']}.\n\n"
          f"**Failed requests during {res['swaps']} swaps: {res['failed_requests']}** of {L['sent']:,} sent "
          f"(statuses {L['statuses']}, connection errors {L['errors'] or 'none'}); admin calls that failed: "
          f"{res['admin_failures']}. Load: {res['concurrency']} connections, closed loop through alias "
          f"`{DOMAIN}`, {L['qps']:.1f} QPS, latency p50 {L['latency_ms']['p50']:.1f} ms / p99 "
          f"{L['latency_ms']['p99']:.1f} ms over {L['elapsed_s']:.0f} s.\n\n"
          + md_table(["step (ms)", "p50", "p95", "max"], rows))
    w.write(res, md)

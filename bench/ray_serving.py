"""``qswap bench serving --ray``: the single process against ``qswap serve --ray`` (Ray Serve).

Servers are real child processes: ``qswap serve`` and ``qswap serve --ray --replicas N`` (each
Ray run starts its own local Ray cluster). Same model, index, encoders and query stream as
``qswap bench serving`` (synthetic document vectors stamped with the real model's space, real
queries encoded on every request).

1. **Overhead and QPS**: for each replica count, the single process and the Ray deployment
   are up together and measured alternately (A B B A) at each concurrency, requests on the
   ``base`` encoder (no multiplexing hop): p50 difference at concurrency 1 = what Ray Serve's
   proxy adds per request.
2. **Multiplexing**: 20 LoRA encoders over 2 replicas with ``--max-encoders-per-replica 10``,
   requests spread uniformly at random over the 20: how often a request lands on a replica that
   must load its encoder (``loads / encoder requests``, counted by the replicas themselves and
   read through Ray), against the single process holding all 20.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from qswap.bench.load_options import ByMode, LoadDefaults, LoadOptions, RunDirs, warm_up
from qswap.bench.processes import ServerProcess, free_port
from qswap.bench.stats import interleaved, summarize
from qswap.bench.results import md_table
from qswap.bench.plots import plot_bars
from qswap.bench.loadgen import LoadResult, Request
from qswap.bench.fixtures import index_meta, load_space_base, load_workload, lora_encoders, qswap_command, qswap_server, register, search_requests, stamped_index
from qswap.errors import InvalidInputError

NAME = "ray-serving"
LOAD = LoadDefaults(levels=ByMode((1, 8), (1, 4)), seconds=ByMode(6.0, 2.0), requests=ByMode(2000, 60),
                    rounds=ByMode(2, 1), rounds_help="A/B rounds per level")
N_MUX = 20
MUX_PER_REPLICA = 10


def parse_replicas(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected replica counts such as 1,2, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError("replica counts must be >= 1")
    return out


def ray_server(index: Path, enc_root: Path, state_dir: Path, log_path: Path, *, model: str, replicas: int,
               max_encoders: int) -> ServerProcess:
    """``qswap serve --ray`` as a child process (it starts and ends its own local Ray cluster)."""
    import shutil
    port = free_port()
    shutil.rmtree(state_dir, ignore_errors=True)
    state_dir.mkdir(parents=True)
    # Same cores in all: the single process's torch uses every core, each replica its share.
    threads = max(1, (os.cpu_count() or 1) // replicas)
    cmd = qswap_command() + ["serve", "--ray", "--replicas", str(replicas), "--max-encoders-per-replica",
                             str(max_encoders), "--replica-threads", str(threads), "--host", "127.0.0.1", "--port", str(port), "--index", str(index),
                             "--read-only-index", "--model", model, "--device", "cpu", "--encoders-root",
                             str(enc_root), "--state-dir", str(state_dir), "--insecure", "--log-format", "json"]
    return ServerProcess(cmd, port, ready_path="/readyz", log_path=log_path, start_timeout_s=600,
                         env={"RAY_USAGE_STATS_ENABLED": "0"})


def replica_counters(state_dir: Path, fresh_after: float, replicas: int,
                     timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """Counters every replica writes to ``<state dir>/replicas/<id>.json`` (every 0.5 s), all
    written after ``fresh_after`` (a ``time.time()``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = {}
        for p in (state_dir / "replicas").glob("*.json"):
            try:
                d = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if d.get("written_at", 0) > fresh_after:
                seen[d["replica"]] = d
        if len(seen) >= replicas:
            return seen
        if time.monotonic() > deadline:
            raise InvalidInputError(f"only {len(seen)} of {replicas} replicas reported counters",
                                    f"see {state_dir}/replicas and the server log")
        time.sleep(0.2)


def random_requests(queries: list[str], keys: list[str], seed: int = 0) -> Any:
    """Request ``i``: a query with an encoder drawn at random (its own draw per seed: the warm-up
    and each measured run use different seeds, so a run does not replay what the warm-up placed)."""
    rng = random.Random(seed)
    order = [rng.randrange(len(keys)) for _ in range(100_000)]
    hdr = (("Content-Type", "application/json"),)

    def make(i: int) -> Request:
        key = keys[order[i % len(order)]]
        return Request("POST", "/v1/search", json.dumps({"query": queries[i % len(queries)], "encoder": key,
                                                         "k": 10}).encode(), hdr, key)
    return make


def _lat(rs: list[LoadResult]) -> dict[str, Any]:
    lat = [x for r in rs for x in r.latencies_ms()]
    return {"qps": sum(r.qps for r in rs) / len(rs), "failed": sum(r.failed for r in rs),
            "requests": sum(r.sent for r in rs), **summarize(lat)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench serving --ray`` (added to ``qswap bench serving``)."""
    p.add_argument("--ray", action="store_true", help="compare with qswap serve --ray (Ray Serve); results in "
                   "bench/results/ray-serving/; load defaults then: concurrency 1,8 (quick 1,4), 6 s (quick 2), "
                   "2000 requests (quick 60), 2 rounds (quick 1)")
    p.add_argument("--replicas", type=parse_replicas, default=[1, 2], help="with --ray: replica counts (default 1,2)")
    p.add_argument("--no-mux", action="store_true", help="with --ray: skip the 20-encoder multiplexing part")
    p.add_argument("--mux-only", action="store_true", help="with --ray: only the 20-encoder multiplexing part")


def run(args: argparse.Namespace) -> int:
    """``qswap bench serving --ray``."""
    opts = LoadOptions.from_args(args, LOAD)
    dirs = RunDirs.create(NAME, opts.quick, args.out)
    tmp = dirs.tmp
    work = load_workload(opts.quick)
    base = load_space_base(args.model)
    idx_dir, _, _ = stamped_index(work, base, tag="default")
    names = [(f"m{i}", "1") for i in range(N_MUX)]
    enc_root = lora_encoders(base, names, tag="ray-mux")
    del base
    res: dict[str, Any] = {"workload": work.source, "index": index_meta(idx_dir), "model": args.model,
                           "levels": opts.levels, "seconds_per_run": opts.seconds, "rounds": opts.rounds,
                           "overhead": {}, "mux": None}
    base_req = search_requests(work.queries, ["base"])
    single = qswap_server(idx_dir, enc_root, tmp / "single-state", tmp / "single.log", model=args.model,
                          extra=["--encoder-memory-mb", "4096"])
    with single:
        res["single_start_s"] = single.start_seconds
        warm_up(single.port, base_req, concurrency=2, requests=32)
        for n in ([] if args.mux_only else args.replicas):
            srv = ray_server(idx_dir, enc_root, tmp / f"ray{n}-state", tmp / f"ray{n}.log", model=args.model,
                             replicas=n, max_encoders=MUX_PER_REPLICA)
            with srv:
                warm_up(srv.port, base_req, concurrency=2 * n, requests=32 * n)
                per: dict[int, dict[str, list[LoadResult]]] = {}
                for c in opts.levels:
                    got = interleaved({"single": lambda c=c: opts.run(single.port, base_req, c),
                                       f"ray x{n}": lambda c=c: opts.run(srv.port, base_req, c)},
                                      rounds=opts.rounds, warmup=0)
                    per[c] = got
                    print(f"replicas={n} c={c}: " + ", ".join(f"{a} {_lat(rs)['qps']:.1f} qps p50 {_lat(rs)['p50']:.1f} ms"
                                                            for a, rs in got.items()), file=sys.stderr)
                # What the Ray path adds to a request without model work: GET /healthz at c=1.
                ping = [Request("GET", "/healthz")]
                hz = interleaved({"single": lambda: opts.run(single.port, ping, 1),
                                  f"ray x{n}": lambda: opts.run(srv.port, ping, 1)}, rounds=max(2, opts.rounds),
                                 warmup=1)
                print(f"replicas={n} /healthz: " + ", ".join(f"{a} p50 {_lat(rs)['p50']:.2f} ms"
                                                           for a, rs in hz.items()), file=sys.stderr)
                res["overhead"][str(n)] = {
                    "healthz_c1": {a: _lat(rs) for a, rs in hz.items()},
                    "start_s": srv.start_seconds,
                    "levels": {str(c): {a: _lat(rs) for a, rs in got.items()} for c, got in per.items()}}
        if not args.no_mux:
            keys = [f"{a}@{v}" for a, v in names]
            for a, v in names:
                register(single, f"{a}-{v}")
            srv = ray_server(idx_dir, enc_root, tmp / "mux-state", tmp / "mux.log", model=args.model, replicas=2,
                             max_encoders=MUX_PER_REPLICA)
            with srv:
                for a, v in names:
                    register(srv, f"{a}-{v}")
                state = tmp / "mux-state"
                c = max(opts.levels)
                warm = warm_up(srv.port, random_requests(work.queries, keys, seed=0), concurrency=c,
                               requests=4 * N_MUX)
                before = replica_counters(state, time.time(), 2)
                # Only the Ray arm is timed against the counters: measure it alone, then the single one.
                ray_runs = [opts.run(srv.port, random_requests(work.queries, keys, seed=1 + r), c)
                            for r in range(opts.rounds)]
                after = replica_counters(state, time.time(), 2)
                single_runs = [opts.run(single.port, random_requests(work.queries, keys, seed=1 + r), c)
                               for r in range(opts.rounds)]
                got = {"single": single_runs, "ray x2": ray_runs}
                delta = {rid: {k: after[rid][k] - before[rid].get(k, 0)
                               for k in ("local", "forwarded", "overflow_local", "served_for_others", "encoder_requests", "loads")}
                         for rid in after if rid in before}
                enc_req = sum(d["encoder_requests"] for d in delta.values())
                loads = sum(d["loads"] for d in delta.values())
                res["mux"] = {"encoders": N_MUX, "replicas": 2, "max_encoders_per_replica": MUX_PER_REPLICA,
                              "concurrency": c, "warmup_requests": warm.sent,
                              "per_replica": delta, "resident_after": {r: after[r]["resident"] for r in after},
                              "encoder_requests": enc_req, "loads": loads,
                              "load_fraction": loads / enc_req if enc_req else None,
                              "forwarded_fraction": (sum(d["forwarded"] for d in delta.values())
                                                     / max(1, sum(d["local"] + d["forwarded"] + d["overflow_local"]
                                                                for d in delta.values()))),
                              "arms": {a: _lat(rs) for a, rs in got.items()}}
                print(f"mux: {loads} loads / {enc_req} encoder requests", file=sys.stderr)
    _write(dirs, res)
    dirs.clean_scratch()
    print(f"wrote {dirs.out}")
    return 0


def _write(dirs: RunDirs, res: dict[str, Any]) -> None:
    w = dirs.writer
    rows = []
    labels, series_single, series_ray = [], [], []
    for n, o in res["overhead"].items():
        for c, arms in o["levels"].items():
            s, r = arms["single"], arms[f"ray x{n}"]
            rows.append([n, c, f"{s['qps']:.1f}", f"{r['qps']:.1f}", f"{s['p50']:.2f}", f"{r['p50']:.2f}",
                         f"{r['p50'] - s['p50']:+.2f}", f"{s['p99']:.1f}", f"{r['p99']:.1f}", r["failed"]])
            labels.append(f"x{n} c{c}")
            series_single.append(s["qps"])
            series_ray.append(r["qps"])
    hz_rows = [[n, f"{o['healthz_c1']['single']['p50']:.2f}", f"{o['healthz_c1'][f'ray x{n}']['p50']:.2f}",
                f"{o['healthz_c1'][f'ray x{n}']['p50'] - o['healthz_c1']['single']['p50']:+.2f}",
                f"{o['healthz_c1']['single']['p99']:.2f}", f"{o['healthz_c1'][f'ray x{n}']['p99']:.2f}"]
               for n, o in res["overhead"].items()]
    text = ["What Ray Serve adds per request (its HTTP proxy and the hop to a replica), without model work: "
            "`GET /healthz`, one client, alternating runs.", "",
            md_table(["replicas", "single p50 ms", "Ray p50 ms", "added p50 ms", "single p99 ms", "Ray p99 ms"],
                     hz_rows), "",
            "Requests on the `base` encoder; single process and Ray deployment measured alternately.", "",
            md_table(["replicas", "concurrency", "single QPS", "Ray QPS", "single p50 ms", "Ray p50 ms",
                      "Ray - single p50 ms", "single p99 ms", "Ray p99 ms", "Ray failed"], rows)]
    m = res.get("mux")
    if m:
        text += ["", f"Multiplexing: {m['encoders']} LoRA encoders, {m['replicas']} replicas, "
                     f"--max-encoders-per-replica {m['max_encoders_per_replica']}, concurrency {m['concurrency']}, "
                     "encoders drawn uniformly at random per request.", "",
                 md_table(["", "value"], [
                     ["requests that had to load their encoder on the replica serving them",
                      f"{m['loads']} / {m['encoder_requests']} = {100 * (m['load_fraction'] or 0):.1f} %"],
                     ["requests forwarded to another replica (multiplexed model id)",
                      f"{100 * m['forwarded_fraction']:.1f} %"],
                     ["single process QPS / p50 ms", f"{m['arms']['single']['qps']:.1f} / {m['arms']['single']['p50']:.1f}"],
                     ["Ray x2 QPS / p50 ms", f"{m['arms']['ray x2']['qps']:.1f} / {m['arms']['ray x2']['p50']:.1f}"]])]
    if labels:
        plot_bars(w.plot_path("qps.png"), labels, {"single process": series_single, "Ray Serve": series_ray},
                  ylabel="requests/s", title="QPS: single process vs qswap serve --ray")
    w.write(res, "\n".join(text))

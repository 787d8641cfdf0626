"""``qswap bench serving --ray``: the single process against ``qswap serve --ray`` (Ray Serve).

Servers are real child processes: ``qswap serve`` and ``qswap serve --ray`` (each Ray run
starts its own local Ray cluster: ``--replicas N`` ingress replicas in front of ``N`` encoder
replicas). Same model, index, encoders and query stream as ``qswap bench serving`` (synthetic
document vectors stamped with the real model's space, real queries encoded on every request).

1. **Overhead and QPS**: for each replica count, the single process and the Ray deployment
   are up together and measured alternately (A B B A): ``GET /healthz`` and a search with a LoRA
   encoder at concurrency 1 (the p50 difference is what Ray adds per request; the LoRA search's
   time breakdown shows the ingress -> encoder hop against the index search, which decides
   where the search runs), and searches on the ``base`` encoder at each concurrency (QPS).
2. **Multiplexing**: 20 LoRA encoders over 2 encoder replicas with
   ``--max-encoders-per-replica 10``, requests spread uniformly at random over the 20: how often
   a request lands on an encoder replica that must load its encoder (``loads / requests``,
   counted by the encoder replicas), against the single process holding all 20; p99 reported.
3. **Autoscaling** (``--autoscale``): encoder deployment with an autoscaling config, a step from
   1 to 32 clients and back to 1: encoder replicas over time, seconds to scale up and down,
   failed requests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

from qswap.bench.load_options import ByMode, LoadDefaults, LoadOptions, RunDirs, warm_up
from qswap.bench.processes import ServerProcess, free_port
from qswap.bench.stats import interleaved, summarize
from qswap.bench.results import md_table
from qswap.bench.plots import plot_bars, plot_lines
from qswap.bench.loadgen import LoadResult, Request
from qswap.bench.fixtures import breakdown, index_meta, load_space_base, load_workload, lora_encoders, qswap_command, qswap_server, register, search_requests, stamped_index
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
               max_encoders: int, autoscaling: dict[str, Any] | None = None, encoder_replicas: int | None = None,
               direct: bool = False) -> ServerProcess:
    """``qswap serve --ray`` as a child process (it starts and ends its own local Ray cluster):
    ``replicas`` ingress and ``replicas`` encoder replicas (or an autoscaled encoder deployment,
    or ``encoder_replicas``: 0 for encoders in the ingress). ``direct``: Serve's direct ingress
    (no proxy; the one ingress replica listens on the port the process is reached at)."""
    import shutil
    port = free_port()
    shutil.rmtree(state_dir, ignore_errors=True)
    state_dir.mkdir(parents=True)
    cpus = os.cpu_count() or 1
    # Same cores in all: the single process's torch uses every core, the encoder replicas
    # share them; Ray's CPU accounting is fractional so every replica fits on this machine.
    top = int(autoscaling["max_replicas"]) if autoscaling else (encoder_replicas or replicas)
    threads = max(1, cpus // replicas)
    cmd = qswap_command() + ["serve", "--ray", "--replicas", str(replicas), "--max-encoders-per-replica",
                             str(max_encoders), "--replica-threads", str(threads),
                             "--replica-cpus", f"{cpus / (4 * replicas):.3f}",
                             "--encoder-cpus", f"{cpus / (2 * top):.3f}",
                             "--host", "127.0.0.1", "--port", str(port), "--index", str(index),
                             "--read-only-index", "--model", model, "--device", "cpu", "--encoders-root",
                             str(enc_root), "--state-dir", str(state_dir), "--insecure", "--log-format", "json"]
    if autoscaling:
        cmd += ["--autoscaling", json.dumps(autoscaling)]
    if encoder_replicas is not None:
        cmd += ["--encoder-replicas", str(encoder_replicas)]
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    if direct:
        port = free_port()   # the replica's own port (Serve's proxy port above goes unused)
        env.update(RAY_SERVE_ENABLE_DIRECT_INGRESS="1", RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(port),
                   RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(port + 1))
    return ServerProcess(cmd, port, ready_path="/readyz", log_path=log_path, start_timeout_s=600, env=env)


def replica_counters(state_dir: Path, fresh_after: float, replicas: int, deployment: str = "encoder",
                     timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """Counters the replicas of ``deployment`` (``ingress`` or ``encoder``) write to
    ``<state dir>/replicas/<id>.json`` (every 0.5 s), all written after ``fresh_after`` (a
    ``time.time()``); at least ``replicas`` of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = live_replicas(state_dir, fresh_after, deployment)
        if len(seen) >= replicas:
            return seen
        if time.monotonic() > deadline:
            raise InvalidInputError(f"only {len(seen)} of {replicas} {deployment} replicas reported counters",
                                    f"see {state_dir}/replicas and the server log")
        time.sleep(0.2)


def live_replicas(state_dir: Path, fresh_after: float, deployment: str = "encoder") -> dict[str, dict[str, Any]]:
    """The counters of every replica of ``deployment`` written after ``fresh_after``."""
    seen = {}
    for p in (state_dir / "replicas").glob("*.json"):
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if d.get("written_at", 0) > fresh_after and d.get("deployment") == deployment:
            seen[d["replica"]] = d
    return seen


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
    p.add_argument("--autoscale", action="store_true", help="with --ray: also the autoscaling step (1 -> 32 -> 1 "
                   "clients, encoder deployment autoscaled 1..4)")
    p.add_argument("--autoscale-only", action="store_true", help="with --ray: only the autoscaling step")
    p.add_argument("--hop", action="store_true", help="with --ray: only the per-request cost of Ray's options "
                   "(proxy + encoder deployment, encoders in the ingress, direct ingress), one replica each, "
                   "against the single process (write it elsewhere with --out)")


def setup(args: argparse.Namespace, name: str, encoders: list[tuple[str, str]],
          tag: str) -> tuple[LoadOptions, RunDirs, Any, Path, Path]:
    """What a Ray serving benchmark runs on: its load options, results folders, workload, the
    default index and LoRA ``encoders`` (name, version) made for it (cached under ``tag``)."""
    opts = LoadOptions.from_args(args, LOAD)
    dirs = RunDirs.create(name, opts.quick, args.out)
    work = load_workload(opts.quick)
    base = load_space_base(args.model)
    idx_dir, _, _ = stamped_index(work, base, tag="default")
    enc_root = lora_encoders(base, encoders, tag=tag)
    return opts, dirs, work, idx_dir, enc_root


def run(args: argparse.Namespace) -> int:
    """``qswap bench serving --ray``."""
    names = [(f"m{i}", "1") for i in range(N_MUX)]
    opts, dirs, work, idx_dir, enc_root = setup(args, NAME, names, "ray-mux")
    tmp = dirs.tmp
    res: dict[str, Any] = {"workload": work.source, "index": index_meta(idx_dir), "model": args.model,
                           "levels": opts.levels, "seconds_per_run": opts.seconds, "rounds": opts.rounds,
                           "overhead": {}, "mux": None, "autoscale": None}
    base_req = search_requests(work.queries, ["base"])
    lora_key = f"{names[0][0]}@{names[0][1]}"
    lora_req = search_requests(work.queries, [lora_key])
    keys = [f"{a}@{v}" for a, v in names]
    single = qswap_server(idx_dir, enc_root, tmp / "single-state", tmp / "single.log", model=args.model,
                          extra=["--encoder-memory-mb", "4096"])
    with single:
        res["single_start_s"] = single.start_seconds
        for a, v in names:
            register(single, f"{a}-{v}")
        warm_up(single.port, base_req, concurrency=2, requests=32)
        warm_up(single.port, lora_req, concurrency=2, requests=32)
        for n in ([] if args.mux_only or args.autoscale_only else args.replicas):
            srv = ray_server(idx_dir, enc_root, tmp / f"ray{n}-state", tmp / f"ray{n}.log", model=args.model,
                             replicas=n, max_encoders=MUX_PER_REPLICA)
            with srv:
                register(srv, f"{names[0][0]}-{names[0][1]}")
                warm_up(srv.port, base_req, concurrency=2 * n, requests=32 * n)
                warm_up(srv.port, lora_req, concurrency=2 * n, requests=32 * n)
                res["overhead"][str(n)] = _overhead(opts, single, srv, n, base_req, lora_req)
        if not (args.no_mux or args.autoscale_only):
            res["mux"] = _mux(opts, single, tmp, idx_dir, enc_root, args.model, work.queries, names, keys)
        if args.autoscale or args.autoscale_only:
            res["autoscale"] = _autoscale(opts, tmp, idx_dir, enc_root, args.model, lora_req, names)
    _write(dirs, res)
    dirs.clean_scratch()
    print(f"wrote {dirs.out}")
    return 0


def _overhead(opts: LoadOptions, single: ServerProcess, srv: ServerProcess, n: int, base_req: Any,
              lora_req: Any) -> dict[str, Any]:
    """Part 1: /healthz and a LoRA search at c=1, base searches at every level; A B B A."""
    per: dict[int, dict[str, list[LoadResult]]] = {}
    arm = f"ray x{n}"
    for c in opts.levels:
        got = interleaved({"single": lambda c=c: opts.run(single.port, base_req, c),
                           arm: lambda c=c: opts.run(srv.port, base_req, c)}, rounds=opts.rounds, warmup=0)
        per[c] = got
        print(f"replicas={n} c={c}: " + ", ".join(f"{a} {_lat(rs)['qps']:.1f} qps p50 {_lat(rs)['p50']:.1f} ms"
                                                for a, rs in got.items()), file=sys.stderr)
    # What the Ray path adds to a request without model work: GET /healthz at c=1.
    ping = [Request("GET", "/healthz")]
    hz = interleaved({"single": lambda: opts.run(single.port, ping, 1), arm: lambda: opts.run(srv.port, ping, 1)},
                     rounds=max(2, opts.rounds), warmup=1)
    # ... and to a search with a LoRA encoder (ingress -> multiplexed encoder replica -> back).
    lora = interleaved({"single": lambda: opts.run(single.port, lora_req, 1, keep_bodies=True),
                        arm: lambda: opts.run(srv.port, lora_req, 1, keep_bodies=True)},
                       rounds=max(2, opts.rounds), warmup=1)
    print(f"replicas={n} c=1: /healthz " + ", ".join(f"{a} p50 {_lat(rs)['p50']:.2f} ms" for a, rs in hz.items())
          + "; LoRA search " + ", ".join(f"{a} p50 {_lat(rs)['p50']:.2f} ms" for a, rs in lora.items()),
          file=sys.stderr)
    return {"healthz_c1": {a: _lat(rs) for a, rs in hz.items()},
            "lora_c1": {a: {**_lat(rs), "breakdown_ms": breakdown(_merged(rs))} for a, rs in lora.items()},
            "start_s": srv.start_seconds,
            "levels": {str(c): {a: _lat(rs) for a, rs in got.items()} for c, got in per.items()}}


def _merged(rs: list[LoadResult]) -> LoadResult:
    """One result holding the samples of several runs (for the time breakdown)."""
    return LoadResult([s for r in rs for s in r.samples], sum(r.elapsed_s for r in rs), rs[0].concurrency,
                      rs[0].stopped_by)


def _mux(opts: LoadOptions, single: ServerProcess, tmp: Path, idx_dir: Path, enc_root: Path, model: str,
         queries: list[str], names: list[tuple[str, str]], keys: list[str]) -> dict[str, Any]:
    """Part 2: 20 encoders over 2 encoder replicas (10 each)."""
    state = tmp / "mux-state"
    srv = ray_server(idx_dir, enc_root, state, tmp / "mux.log", model=model, replicas=2,
                     max_encoders=MUX_PER_REPLICA)
    with srv:
        for a, v in names:
            register(srv, f"{a}-{v}")
        c = max(opts.levels)
        warm = warm_up(srv.port, random_requests(queries, keys, seed=0), concurrency=c, requests=4 * N_MUX)
        before = replica_counters(state, time.time(), 2)
        # Only the Ray arm is timed against the counters: measure it alone, then the single one.
        ray_runs = [opts.run(srv.port, random_requests(queries, keys, seed=1 + r), c) for r in range(opts.rounds)]
        after = replica_counters(state, time.time(), 2)
        single_runs = [opts.run(single.port, random_requests(queries, keys, seed=1 + r), c)
                       for r in range(opts.rounds)]
    got = {"single": single_runs, "ray x2": ray_runs}
    delta = {rid: {k: after[rid][k] - before[rid].get(k, 0) for k in ("requests", "rows", "batches", "loads")}
             for rid in after if rid in before}
    calls = sum(d["requests"] for d in delta.values())
    loads = sum(d["loads"] for d in delta.values())
    requests = sum(r.sent for r in ray_runs)
    print(f"mux: {loads} loads / {requests} requests ({calls} encoder calls)", file=sys.stderr)
    return {"encoders": N_MUX, "replicas": 2, "max_encoders_per_replica": MUX_PER_REPLICA, "concurrency": c,
            "warmup_requests": warm.sent, "per_replica": delta,
            "resident_after": {r: after[r]["resident"] for r in after},
            "requests": requests, "encoder_calls": calls, "loads": loads,
            "load_fraction": loads / requests if requests else None,
            "arms": {a: _lat(rs) for a, rs in got.items()}}


AUTOSCALING = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2, "metrics_interval_s": 0.5,
               "look_back_period_s": 2.0, "upscale_delay_s": 1.0, "downscale_delay_s": 10.0}


def _autoscale(opts: LoadOptions, tmp: Path, idx_dir: Path, enc_root: Path, model: str, lora_req: Any,
               names: list[tuple[str, str]], high: int = 32, hold_s: float = 60.0) -> dict[str, Any]:
    """Part 3: 1 client, then ``high`` clients until the encoders scaled up (at most ``hold_s``),
    then 1 client until they scaled down (at most ``3 * hold_s``): replica counts over time."""
    import threading
    from qswap.bench.loadgen import run_load_sync
    from qswap.bench.load_options import LOAD_HOST
    state = tmp / "scale-state"
    srv = ray_server(idx_dir, enc_root, state, tmp / "scale.log", model=model, replicas=1, max_encoders=4,
                     autoscaling=AUTOSCALING)
    timeline: list[tuple[float, int]] = []
    phases: dict[str, Any] = {}
    with srv:
        register(srv, f"{names[0][0]}-{names[0][1]}")
        warm_up(srv.port, lora_req, concurrency=1, requests=16)
        t0 = time.monotonic()

        def count() -> int:
            n = len(live_replicas(state, time.time() - 1.5))
            timeline.append((round(time.monotonic() - t0, 2), n))
            return n

        def phase(name: str, clients: int, seconds: float, done: Callable[[int], bool]) -> float | None:
            stop = threading.Event()
            out: list[LoadResult] = []
            th = threading.Thread(target=lambda: out.append(run_load_sync(
                LOAD_HOST, srv.port, lora_req, concurrency=clients, duration_s=seconds, max_requests=10**9,
                should_stop=stop.is_set)))
            start = time.monotonic()
            th.start()
            reached = None
            while th.is_alive():
                if reached is None and done(count()):
                    reached = time.monotonic() - start
                    stop.set()
                time.sleep(0.5)
            th.join()
            r = out[0]
            phases[name] = {"clients": clients, "seconds_to_target": reached, "t_start": round(start - t0, 2),
                            **_lat([r]),
                            "statuses": r.statuses()}
            print(f"autoscale {name}: {clients} clients, target reached after {reached} s, "
                  f"{r.failed} failed of {r.sent}", file=sys.stderr)
            return reached

        start_n = count()
        phase("low", 1, 5.0, lambda n: False)
        phase("up", high, hold_s, lambda n: n >= 2 and n > start_n)
        phase("down", 1, 3 * hold_s, lambda n: n <= AUTOSCALING["min_replicas"])
    return {"config": AUTOSCALING, "start_replicas": start_n, "phases": phases, "timeline": timeline,
            "failed": sum(p["failed"] for p in phases.values())}


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
    lora_rows = []
    for n, o in res["overhead"].items():
        s, r = o["lora_c1"]["single"], o["lora_c1"][f"ray x{n}"]
        bs, br = s["breakdown_ms"], r["breakdown_ms"]
        lora_rows.append([n, f"{s['p50']:.2f}", f"{r['p50']:.2f}", f"{r['p50'] - s['p50']:+.2f}",
                          f"{bs['encode_p50']:.2f}", f"{br['encode_p50']:.2f}", f"{bs['search_p50']:.3f}",
                          f"{br['search_p50']:.3f}"])
    text = ["What Ray Serve adds per request (its HTTP proxy and the hop to a replica), without model work: "
            "`GET /healthz`, one client, alternating runs.", "",
            md_table(["replicas", "single p50 ms", "Ray p50 ms", "added p50 ms", "single p99 ms", "Ray p99 ms"],
                     hz_rows), "",
            "A search with one LoRA encoder, one client: on Ray the ingress sends the batch to a multiplexed "
            "encoder replica (its `encode` time includes that hop) and searches the index itself.", "",
            md_table(["replicas", "single p50 ms", "Ray p50 ms", "added p50 ms", "single encode p50 ms",
                      "Ray encode (+hop) p50 ms", "single search p50 ms", "Ray search p50 ms"], lora_rows), "",
            "Requests on the `base` encoder; single process and Ray deployment measured alternately.", "",
            md_table(["replicas", "concurrency", "single QPS", "Ray QPS", "single p50 ms", "Ray p50 ms",
                      "Ray - single p50 ms", "single p99 ms", "Ray p99 ms", "Ray failed"], rows)]
    m = res.get("mux")
    if m:
        text += ["", f"Multiplexing: {m['encoders']} LoRA encoders, {m['replicas']} encoder replicas, "
                     f"--max-encoders-per-replica {m['max_encoders_per_replica']}, concurrency {m['concurrency']}, "
                     "encoders drawn uniformly at random per request, after a warm-up.", "",
                 md_table(["", "value"], [
                     ["requests whose encoder had to be loaded on the encoder replica serving them",
                      f"{m['loads']} / {m['requests']} = {100 * (m['load_fraction'] or 0):.2f} %"],
                     ["single process QPS / p50 / p99 ms", f"{m['arms']['single']['qps']:.1f} / "
                      f"{m['arms']['single']['p50']:.1f} / {m['arms']['single']['p99']:.1f}"],
                     ["Ray x2 QPS / p50 / p99 ms", f"{m['arms']['ray x2']['qps']:.1f} / "
                      f"{m['arms']['ray x2']['p50']:.1f} / {m['arms']['ray x2']['p99']:.1f}"]])]
    a = res.get("autoscale")
    if a:
        text += ["", f"Autoscaling: encoder deployment `{json.dumps(a['config'])}`, one LoRA encoder; "
                     f"clients 1 -> 32 -> 1 (started with {a['start_replicas']} encoder replica(s)).", "",
                 md_table(["phase", "clients", "seconds to target", "requests", "failed", "p50 ms", "p99 ms"],
                          [[k, p["clients"], "-" if p["seconds_to_target"] is None else f"{p['seconds_to_target']:.1f}",
                            p["requests"], p["failed"], f"{p['p50']:.1f}", f"{p['p99']:.1f}"]
                           for k, p in ((k, a["phases"][k]) for k in ("low", "up", "down") if k in a["phases"])]), "",
                 "Encoder replicas over time (s, replicas): " + ", ".join(
                     f"{t}:{n}" for i, (t, n) in enumerate(a["timeline"]) if i == 0 or a["timeline"][i - 1][1] != n)]
    if a:
        plot_lines(w.plot_path("autoscale.png"), [t for t, _ in a["timeline"]],
                   {"encoder replicas": [n for _, n in a["timeline"]]}, xlabel="seconds (1 -> 32 -> 1 clients)",
                   ylabel="encoder replicas", title="Encoder deployment autoscaling under a load step",
                   vlines=[p["t_start"] for p in a["phases"].values()], vlabel="phase starts (1, 32, 1 clients)")
    if labels:
        plot_bars(w.plot_path("qps.png"), labels, {"single process": series_single, "Ray Serve": series_ray},
                  ylabel="requests/s", title="QPS: single process vs qswap serve --ray")
    w.write(res, "\n".join(text))

"""``qswap bench cycle``: where a server's time goes under load, by a sampling profiler and CPU time.

One ``qswap serve`` (its default backend) with one LoRA domain (rank 16, as ``qswap bench peer``)
over the stamped Debian index; ``--concurrency`` closed-loop clients send one query per call
to ``/v1/search`` (k=10) or ``/v1/embeddings`` (``--route``) while py-spy (the standard sampling
profiler for Python: it reads the process from outside, no instrumentation) samples every
thread of the server 100 times a second. Reported: QPS, p50 and p99 of that run, the server
process's CPU time per request (user + system, from ``/proc/<pid>/stat``) and the load
generator's own (it runs in this process), the share of samples per thread, and the top
functions by own time (the frame on top of the stack: what the thread was doing) and by
inclusive time (anywhere on the stack). Native code (ONNX Runtime's kernels, FAISS) shows as
the Python frame that called it. Idle threads (waiting on a lock or a socket) are not sampled,
so shares are of busy time. ``--serve-arg`` passes options to the server (e.g. to compare
ONNX Runtime settings), ``--no-profile`` measures without the profiler.

``--tiny`` serves a tiny random-weight model (2 layers, 32 wide) instead: its forward costs next
to nothing, so the CPU time per request is what the server spends around the forward pass
(HTTP, routing, validation, tokenising, the serving loop's hand-offs, the index search, JSON).
``--arm LABEL=REV`` (repeat) runs code versions side by side, as ``qswap bench start`` does:
one server per arm, started together, the arms alternating at every point and their order
reversed every round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from qswap.bench.load_options import ByMode, LoadDefaults, LoadOptions, RunDirs, add_load_arguments, load_point

NAME = "cycle"
LOAD = LoadDefaults(levels=ByMode((32,), (4,)), seconds=ByMode(20.0, 1.0), requests=ByMode(1_000_000, 60),
                    rounds=ByMode(1, 1), rounds_help="runs per level")
RANK = 16
TOP = 15
ROUTES = ("search", "embeddings")
TINY_MODEL = "tiny-bert-h32-l2"   # the folder under the bench cache


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench cycle``."""
    from qswap.bench.fixtures import MODEL
    from qswap.bench.load_options import add_model_argument
    add_load_arguments(p, LOAD)
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="an extra argument for qswap serve (repeat; e.g. --serve-arg=--batch-window-ms=0)")
    p.add_argument("--no-profile", action="store_true", help="measure without py-spy")
    p.add_argument("--route", default="search",
                   help=f"comma-separated routes to load: {', '.join(ROUTES)} (default search)")
    p.add_argument("--tiny", action="store_true",
                   help="serve a tiny random-weight model: the forward costs next to nothing (overrides --model)")
    p.add_argument("--arm", action="append", default=None, metavar="LABEL=REV",
                   help="a code version to serve: a git revision, or '.' for the installed working tree "
                        "(repeat; default: this=.)")
    add_model_argument(p, MODEL)


def collapse(raw: str) -> dict[str, Any]:
    """Thread shares and top functions from py-spy's raw (collapsed-stack) output.

    Args:
        raw: lines ``thread (tid): name;frame;...;frame count``.

    Returns:
        ``{"samples", "threads": {name: share}, "self": [[frame, share]], "inclusive": [[frame, share]]}``.
    """
    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        parts = stack.split(";")
        name = parts[0].partition(": ")[2] or parts[0]
        # Thread-pool workers carry their index (qswap-pipe_0, _1): one row per pool.
        threads[name.rstrip("0123456789").rstrip("_-")] += n
        frames = parts[1:]
        if frames:
            own[frames[-1]] += n
            for f in set(frames):
                incl[f] += n
        total += n
    share = (lambda c: [[k, v / total] for k, v in c.most_common(TOP)]) if total else (lambda c: [])
    return {"samples": total, "threads": {k: v / total for k, v in threads.most_common()} if total else {},
            "self": share(own), "inclusive": share(incl)}


def _profiled(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                             "--rate", "100", "--format", "raw", "--threads", "--nonblocking", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads), from ``/proc``."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()   # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tiny_model() -> str:
    from qswap.bench.fixtures import cache_dir
    from qswap.bench.tiny_model import make_tiny_model
    d = cache_dir() / TINY_MODEL
    if not (d / "qswap_base.json").is_file():
        make_tiny_model(d)
    return str(d)


def _point(qs: Any, make: Any, c: int, opts: LoadOptions, profile: Path | None) -> dict[str, Any]:
    """One measured run on server ``qs``: QPS, latency, CPU ms per request (server, load generator),
    and the profile when ``profile`` names where py-spy writes."""
    spy = None if profile is None else _profiled(qs.proc.pid, opts.seconds, profile)
    srv0, gen0 = cpu_seconds(qs.proc.pid), time.process_time()
    r = opts.run(qs.port, make, c)
    srv_s, gen_s = cpu_seconds(qs.proc.pid) - srv0, time.process_time() - gen0
    point = load_point(r)
    n = max(1, point["ok"] + point["failed"])
    point["server_cpu_ms"] = 1000 * srv_s / n
    point["loadgen_cpu_ms"] = 1000 * gen_s / n
    if spy is not None and profile is not None:
        _, err = spy.communicate(timeout=opts.seconds + 60)
        point["profile"] = collapse(profile.read_text()) if profile.exists() else {"error": err.decode()[-300:]}
    return point


def run(args: argparse.Namespace) -> int:
    """``qswap bench cycle``."""
    from contextlib import ExitStack

    from qswap.bench.fixtures import (embedding_requests, index_meta, load_space_base, load_workload, lora_encoders,
                                      qswap_server, register, search_requests, stamped_index, wait_for_runtime,
                                      warm_until_settled)
    from qswap.bench.revisions import arm_command, parse_arms

    opts = LoadOptions.from_args(args, LOAD)
    routes = [r.strip() for r in args.route.split(",") if r.strip()]
    if not routes or any(r not in ROUTES for r in routes):
        print(f"qswap bench cycle: --route takes {', '.join(ROUTES)}", file=sys.stderr)
        return 2
    dirs = RunDirs.create(NAME, opts.quick, args.out)
    if not args.no_profile and not (shutil.which("py-spy") or (Path(sys.executable).parent / "py-spy").exists()):
        print("qswap bench cycle: py-spy is not installed (pip install py-spy), or pass --no-profile", file=sys.stderr)
        return 2
    arms = parse_arms(args.arm)
    model = _tiny_model() if args.tiny else args.model
    work = load_workload(opts.quick)
    base = load_space_base(model)
    idx_dir, _, _ = stamped_index(work, base, tag="default")
    enc_root = lora_encoders(base, [("d0", "1")], rank=RANK, tag="peer")
    del base
    res: dict[str, Any] = {"workload": work.source, "index": index_meta(idx_dir),
                           "model": "tiny random-weight BERT (2 layers, 32 wide)" if args.tiny else args.model,
                           "serve_args": args.serve_arg, "seconds": opts.seconds, "rounds": opts.rounds,
                           "arms": dict(arms), "routes": routes, "points": []}
    makes = {"search": search_requests(work.queries, ["d0@1"]), "embeddings": embedding_requests(work.queries, ["d0@1"])}
    with ExitStack() as stack:
        servers = {}
        for label, rev in arms:
            cmd, env = arm_command(label, rev, dirs.tmp / "arms")
            qs = stack.enter_context(qswap_server(idx_dir, enc_root, dirs.tmp / f"state-{label}",
                                                  dirs.tmp / f"qswap-{label}.log", model=model,
                                                  extra=list(args.serve_arg), command=cmd, env=env))
            register(qs, "d0-1")
            wait_for_runtime(qs, ["base", "d0@1"], "onnx-shared")
            for route in routes:
                # Past the hot-encoder window (512 rows), then until the server builds nothing more (the hot
                # encoder's merged graph, its one-core twin), so that no build runs during a measured point.
                warm_until_settled(qs, makes[route], concurrency=max(opts.levels),
                                   requests=700 if not opts.quick else 8)
            servers[label] = qs
        for rnd in range(opts.rounds):
            order = list(servers) if rnd % 2 == 0 else list(reversed(servers))
            for route in routes:
                for c in opts.levels:
                    for label in order:
                        raw = None if args.no_profile else dirs.tmp / f"pyspy-{label}-{route}-{c}-{rnd}.txt"
                        point = _point(servers[label], makes[route], c, opts, raw)
                        res["points"].append({"arm": label, "route": route, "concurrency": c, "round": rnd, **point})
                        print(f"round {rnd} {label} {route} c={c}: {point['qps']:.1f}/s p50 {point['p50_ms']:.1f} "
                              f"p99 {point['p99_ms']:.1f} ms; CPU ms/request server {point['server_cpu_ms']:.2f} "
                              f"load generator {point['loadgen_cpu_ms']:.2f}", file=sys.stderr, flush=True)
        res["rss_bytes"] = {label: qs.rss() for label, qs in servers.items()}
    _write(dirs, res)
    dirs.clean_scratch()
    print(f"wrote {dirs.out}")
    return 0


def _median(points: list[dict[str, Any]], key: str) -> float:
    import statistics
    return statistics.median(p[key] for p in points)


def _write(dirs: RunDirs, res: dict[str, Any]) -> None:
    from qswap.bench.results import md_table

    arms = res["arms"]
    md = (f"Workload: {res['workload']}; model: {res['model']}; search over {res['index']['documents']:,} documents "
          f"(k=10), one LoRA domain (rank {RANK}); one query per call, closed loop, {res['seconds']:g} s per point, "
          f"{res['rounds']} round(s), arms alternating (order reversed every round). Server arguments: "
          f"{' '.join(res['serve_args']) or '(defaults)'}. CPU ms per request: the server process's user + system "
          "time (all its threads), and the load generator's (this process), over the run, per request sent. "
          "Medians over the rounds; the load average is at the end of each point.\n\n")
    keys = list(dict.fromkeys((p["route"], p["concurrency"]) for p in res["points"]))
    rows = []
    for route, c in keys:
        for label in arms:
            pts = [p for p in res["points"] if p["route"] == route and p["concurrency"] == c and p["arm"] == label]
            rows.append([route, c, label, arms[label], f"{_median(pts, 'qps'):.1f}", f"{_median(pts, 'p99_ms'):.1f}",
                         f"{_median(pts, 'server_cpu_ms'):.2f}", f"{_median(pts, 'loadgen_cpu_ms'):.2f}",
                         sum(p["failed"] for p in pts),
                         " / ".join(f"{p['loadavg'][0]:.1f}" for p in pts if p["loadavg"])])
    md += md_table(["route", "c", "arm", "revision", "QPS", "p99 ms", "server CPU ms/req", "load generator CPU ms/req",
                    "failed", "load"], rows) + "\n"
    for p in res["points"]:
        prof = p.get("profile")
        if prof and "samples" in prof:
            md += (f"## {p['arm']}, {p['route']}, c={p['concurrency']}, round {p['round']}\n\n"
                   f"{prof['samples']:,} busy samples. Threads:\n\n"
                   + md_table(["thread", "share"], [[k, f"{v:.1%}"] for k, v in prof["threads"].items()])
                   + "\nTop own time:\n\n" + md_table(["frame", "share"], [[k, f"{v:.1%}"] for k, v in prof["self"]])
                   + "\nTop inclusive time:\n\n"
                   + md_table(["frame", "share"], [[k, f"{v:.1%}"] for k, v in prof["inclusive"]]) + "\n")
        elif prof:
            md += f"\nprofiler failed ({p['arm']}, {p['route']}, c={p['concurrency']}): {prof['error']}\n\n"
    print(md)
    dirs.writer.write(res, md)

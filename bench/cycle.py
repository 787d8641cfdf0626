"""``qswap bench cycle``: where a server's time goes under load, by a sampling profiler.

One ``qswap serve`` (its default backend) with one LoRA domain (rank 16, as ``qswap bench peer``)
over the stamped Debian index; ``--concurrency`` closed-loop clients send one query per call
to ``/v1/search`` while py-spy (the standard sampling profiler for Python: it reads the
process from outside, no instrumentation) samples every thread of the server 100 times a
second. Reported: QPS, p50 and p99 of that run, the share of samples per thread, and the top
functions by own time (the frame on top of the stack: what the thread was doing) and by
inclusive time (anywhere on the stack). Native code (ONNX Runtime's kernels, FAISS) shows as
the Python frame that called it. Idle threads (waiting on a lock or a socket) are not sampled,
so shares are of busy time. ``--serve-arg`` passes options to the server (e.g. to compare
ONNX Runtime settings), ``--no-profile`` measures without the profiler.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from qswap.bench.load_options import ByMode, LoadDefaults, LoadOptions, RunDirs, add_load_arguments, load_point, warm_up

NAME = "cycle"
LOAD = LoadDefaults(levels=ByMode((32,), (4,)), seconds=ByMode(20.0, 1.0), requests=ByMode(1_000_000, 60),
                    rounds=ByMode(1, 1), rounds_help="runs per level")
RANK = 16
TOP = 15


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench cycle``."""
    from qswap.bench.fixtures import MODEL
    from qswap.bench.load_options import add_model_argument
    add_load_arguments(p, LOAD)
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="an extra argument for qswap serve (repeat; e.g. --serve-arg=--batch-window-ms=0)")
    p.add_argument("--no-profile", action="store_true", help="measure without py-spy")
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


def run(args: argparse.Namespace) -> int:
    """``qswap bench cycle``."""
    from qswap.bench.fixtures import (index_meta, load_space_base, load_workload, lora_encoders, qswap_server,
                                      register, search_requests, stamped_index, wait_for_runtime)

    opts = LoadOptions.from_args(args, LOAD)
    dirs = RunDirs.create(NAME, opts.quick, args.out)
    if not args.no_profile and not (shutil.which("py-spy") or (Path(sys.executable).parent / "py-spy").exists()):
        print("qswap bench cycle: py-spy is not installed (pip install py-spy), or pass --no-profile", file=sys.stderr)
        return 2
    work = load_workload(opts.quick)
    base = load_space_base(args.model)
    idx_dir, _, _ = stamped_index(work, base, tag="default")
    enc_root = lora_encoders(base, [("d0", "1")], rank=RANK, tag="peer")
    del base
    res: dict[str, Any] = {"workload": work.source, "index": index_meta(idx_dir), "model": args.model,
                           "serve_args": args.serve_arg, "seconds": opts.seconds, "levels": {}}
    with qswap_server(idx_dir, enc_root, dirs.tmp / "state", dirs.tmp / "qswap.log", model=args.model,
                      extra=list(args.serve_arg)) as qs:
        register(qs, "d0-1")
        wait_for_runtime(qs, ["base", "d0@1"], "onnx-shared")
        make = search_requests(work.queries, ["d0@1"])
        warm_up(qs.port, make, concurrency=4, requests=64 if not opts.quick else 8, duration_s=60)
        for c in opts.levels:
            raw = dirs.tmp / f"pyspy-{c}.txt"
            spy = None if args.no_profile else _profiled(qs.proc.pid, opts.seconds, raw)
            point = load_point(opts.run(qs.port, make, c))
            if spy is not None:
                _, err = spy.communicate(timeout=opts.seconds + 60)
                point["profile"] = collapse(raw.read_text()) if raw.exists() else {"error": err.decode()[-300:]}
            res["levels"][str(c)] = point
            print(f"c={c}: {point['qps']:.1f}/s p50 {point['p50_ms']:.1f} p99 {point['p99_ms']:.1f} ms", file=sys.stderr)
        res["rss_bytes"] = qs.rss()
    _write(dirs, res)
    dirs.clean_scratch()
    print(f"wrote {dirs.out}")
    return 0


def _write(dirs: RunDirs, res: dict[str, Any]) -> None:
    from qswap.bench.results import md_table

    md = (f"Workload: {res['workload']}; search over {res['index']['documents']:,} documents (k=10), one LoRA "
          f"domain (rank {RANK}); one query per call, closed loop, {res['seconds']:g} s per level. Server "
          f"arguments: {' '.join(res['serve_args']) or '(defaults)'}. Profile: py-spy, 100 samples/s, all threads, "
          "busy samples only; native code counted in the Python frame that called it.\n\n")
    for c, p in res["levels"].items():
        md += f"## c={c}\n\n" + md_table(["QPS", "p50 ms", "p99 ms", "failed", "load"],
                                         [[p["qps"], p["p50_ms"], p["p99_ms"], p["failed"],
                                           f"{p['loadavg'][0]:.1f}" if p["loadavg"] else ""]])
        prof = p.get("profile")
        if prof and "samples" in prof:
            md += (f"\n{prof['samples']:,} busy samples. Threads:\n\n"
                   + md_table(["thread", "share"], [[k, f"{v:.1%}"] for k, v in prof["threads"].items()])
                   + "\nTop own time:\n\n" + md_table(["frame", "share"], [[k, f"{v:.1%}"] for k, v in prof["self"]])
                   + "\nTop inclusive time:\n\n"
                   + md_table(["frame", "share"], [[k, f"{v:.1%}"] for k, v in prof["inclusive"]]) + "\n")
        elif prof:
            md += f"\nprofiler failed: {prof['error']}\n\n"
    print(md)
    dirs.writer.write(res, md)

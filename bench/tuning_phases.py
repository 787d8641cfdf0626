"""``qswap bench tuning --e2e``: where the wall time of one ``qswap tune run`` goes.

Runs ``qswap tune run`` in a fresh process on a BEIR directory whose documents a qswap index
already holds (``--index``: documents come from its stored vectors, never re-embedded), with the
README's recommended CPU settings unless ``--tune-args`` replaces them, and records the run's own
per-phase timings (``report.json`` ``phases``: load, documents, mining, training, evaluation,
artifact check), steps, seconds per step and the verdicts, with the load average around it.
``--before SECONDS`` adds a reference total measured earlier (e.g. the old code's run on the
same data) to the table, labelled as such.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qswap.bench.plots import plot_bars
from qswap.bench.results import ResultWriter, default_results_dir, md_table, results_dir_for
from qswap.errors import InvalidInputError

NAME = "tuning"
#: The README's recommended CPU settings for a 10,000-document English run (see "Tuning query encoders").
RECOMMENDED = "--method partial --recipe cpu --val-size 400 --test-size 1000 --negatives 3 --mine index"
BUDGET_S = 600.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the ``--e2e`` mode of ``qswap bench tuning``."""
    g = p.add_argument_group("--e2e: one `qswap tune run` end to end, per phase")
    g.add_argument("--e2e", action="store_true", help="time one `qswap tune run` per phase instead of the ST comparison")
    g.add_argument("--beir", type=Path, default=None, help="BEIR directory (e.g. 10,000 Debian documents)")
    g.add_argument("--index", type=Path, default=None, help="a qswap index of the same documents (base model's space)")
    g.add_argument("--lang", default="en", help="training language (default en)")
    g.add_argument("--eval-langs", default="en,de,fr,it", help="evaluation languages; the others are sentinels too")
    g.add_argument("--tune-args", default=RECOMMENDED, help=f"tuning options (default: {RECOMMENDED})")
    g.add_argument("--before", type=float, default=None,
                   help="a total in seconds measured earlier on the same data, shown as the 'before' row")
    g.add_argument("--before-label", default="before", help="what --before is")


def run(args: argparse.Namespace) -> int:
    """``qswap bench tuning --e2e``."""
    if args.beir is None or args.index is None:
        raise InvalidInputError("--e2e needs --beir DIR and --index IDX", "build the index with `qswap index build DIR`")
    # Beside the sentence-transformers comparison, not over it.
    out = results_dir_for(NAME, bool(args.quick), args.out or (None if args.quick else default_results_dir(NAME) / "e2e"))
    w = ResultWriter(NAME, out)
    tmp = out / "tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    langs = [x for x in args.eval_langs.split(",") if x]
    cmd = [sys.executable, "-m", "qswap.cli", "tune", "run", "--beir", str(args.beir), "--lang", args.lang,
           "--index", str(args.index), *shlex.split(args.tune_args), "--device", "cpu", "--quiet",
           "--out", str(tmp / "encoder"), "--cache-dir", str(tmp / "cache")]
    if langs:
        cmd += ["--eval-langs", ",".join(langs)]
    for lg in langs:
        if lg != args.lang:
            cmd += ["--sentinel", f"{lg}=beir:{args.beir}:{lg}"]
    load_before = os.getloadavg()
    print("running: " + " ".join(cmd), file=sys.stderr)
    t0 = time.perf_counter()
    with open(tmp / "tune.log", "wb") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        tail = "\n".join((tmp / "tune.log").read_text(errors="replace").splitlines()[-20:])
        raise InvalidInputError(f"qswap tune run failed ({r.returncode})\n{tail}", f"see {tmp / 'tune.log'}")
    rep = json.loads((tmp / "encoder" / "report.json").read_text())
    tr = rep["training"]
    res: dict[str, Any] = {
        "command": cmd, "wall_seconds": wall, "phases": rep["phases"], "report_total_seconds": rep["wall_seconds_total"],
        "steps": tr["steps"], "seconds_per_step": tr.get("seconds_per_step"), "best_epoch": tr["best_epoch"],
        "stopped": tr["stopped"], "documents": rep["data"]["documents"], "splits": rep["data"]["splits"],
        "guard_passed": rep["guard"]["passed"], "load_before": load_before, "load_after": os.getloadavg(),
        "before_seconds": args.before, "before_label": args.before_label,
        "summary": (tmp / "tune.log").read_text(errors="replace").splitlines()[-9:]}
    _write(w, res)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _write(w: ResultWriter, res: dict[str, Any]) -> None:
    ph = res["phases"]
    rows = [[k, f"{v:.0f}", f"{100 * v / res['wall_seconds']:.0f} %"] for k, v in ph.items()]
    rows.append(["other (process start, report, save)", f"{res['wall_seconds'] - sum(ph.values()):.0f}", ""])
    rows.append(["**total (process wall)**", f"**{res['wall_seconds']:.0f}**", ""])
    if res["before_seconds"]:
        rows.append([res["before_label"], f"{res['before_seconds']:.0f}", ""])
    met = res["wall_seconds"] <= BUDGET_S
    md = (f"`{' '.join(res['command'][2:])}`\n\n"
          f"{res['documents']:,} documents (from the index: none embedded), splits {res['splits']}; "
          f"{res['steps']} training steps at {res['seconds_per_step']:.2f} s/step, best epoch {res['best_epoch']} "
          f"(stopped by {res['stopped']}); guard {'passed' if res['guard_passed'] else 'refused'}. Load average "
          f"{res['load_before'][0]:.2f} before, {res['load_after'][0]:.2f} after.\n\n"
          + md_table(["phase", "seconds", "share"], rows)
          + f"\nBudget: <= {BUDGET_S / 60:.0f} min: {'met' if met else '**missed**'}\n\n```\n"
          + "\n".join(res["summary"]) + "\n```\n")
    plot_bars(w.plot_path("phases.png"), list(ph), {"seconds": list(ph.values())}, ylabel="seconds",
              title=f"qswap tune run, {res['documents']:,} documents: {res['wall_seconds'] / 60:.1f} min")
    w.write(res, md)
    print(md)

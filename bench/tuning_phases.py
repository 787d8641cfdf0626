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
BUDGET_S = 180.0   # issue 27: a 10,000-document run within three minutes on 2 cores


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the ``--e2e`` mode of ``qswap bench tuning``."""
    g = p.add_argument_group("--e2e: one `qswap tune run` end to end, per phase")
    g.add_argument("--e2e", action="store_true", help="time one `qswap tune run` per phase instead of the ST comparison")
    g.add_argument("--beir", type=Path, default=None, help="BEIR directory (e.g. 10,000 Debian documents)")
    g.add_argument("--index", type=Path, default=None, help="a qswap index of the same documents (base model's space)")
    g.add_argument("--lang", default="en", help="training language (default en)")
    g.add_argument("--eval-langs", default="en,de,fr,it", help="evaluation languages; the others are sentinels too")
    g.add_argument("--tune-args", default=RECOMMENDED, help=f"tuning options (default: {RECOMMENDED})")
    g.add_argument("--compare-args", default=None,
                   help="also run with these options added (e.g. the previous settings), in the same session, "
                        "and test the two encoders against each other per language (the guard's paired test)")
    g.add_argument("--compare-label", default="previous settings", help="what --compare-args / --reference is")
    g.add_argument("--reference", type=Path, default=None,
                   help="instead of --compare-args: the encoder directory of a `qswap tune run` with the "
                        "previous settings on the same data (e.g. run beside this one); waits for its "
                        "report.json, shows its phases and tests the two encoders against each other")
    g.add_argument("--candidate", type=Path, default=None,
                   help="with --reference: compare an encoder directory tuned with the default settings by "
                        "another process instead of running one (timings: each run's own clock)")
    g.add_argument("--before", type=float, default=None,
                   help="a total in seconds measured earlier on the same data, shown as the 'before' row")
    g.add_argument("--before-label", default="before", help="what --before is")


def _tune(args: argparse.Namespace, tmp: Path, label: str, extra: str) -> dict[str, Any]:
    """One ``qswap tune run`` in a fresh process; its phases, steps and verdicts."""
    langs = [x for x in args.eval_langs.split(",") if x]
    work = tmp / label.replace(" ", "-")
    work.mkdir(parents=True)
    cmd = [sys.executable, "-m", "qswap.cli", "tune", "run", "--allow-identity", "--beir", str(args.beir), "--lang", args.lang,
           "--index", str(args.index), *shlex.split(args.tune_args), *shlex.split(extra), "--device", "cpu",
           "--quiet", "--out", str(work / "encoder"), "--cache-dir", str(work / "cache")]
    if langs:
        cmd += ["--eval-langs", ",".join(langs)]
    for lg in langs:
        if lg != args.lang:
            cmd += ["--sentinel", f"{lg}=beir:{args.beir}:{lg}"]
    load_before = os.getloadavg()
    print("running: " + " ".join(cmd), file=sys.stderr)
    t0 = time.perf_counter()
    with open(work / "tune.log", "wb") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        tail = "\n".join((work / "tune.log").read_text(errors="replace").splitlines()[-20:])
        raise InvalidInputError(f"qswap tune run failed ({r.returncode})\n{tail}", f"see {work / 'tune.log'}")
    rep = json.loads((work / "encoder" / "report.json").read_text())
    tr = rep["training"]
    return {
        "label": label, "encoder_dir": work / "encoder",
        "command": cmd, "wall_seconds": wall, "phases": rep["phases"], "report_total_seconds": rep["wall_seconds_total"],
        "steps": tr["steps"], "seconds_per_step": tr.get("seconds_per_step"), "best_epoch": tr["best_epoch"],
        "stopped": tr["stopped"], "documents": rep["data"]["documents"], "splits": rep["data"]["splits"],
        "recipe": rep.get("recipe"), "query_runtime": rep.get("query_runtime"),
        "artifact_check": rep.get("artifact_check"), "cpu_seconds": rep.get("cpu_seconds_total"),
        "guard_passed": rep["guard"]["passed"], "guard": rep["guard"], "load_before": load_before,
        "load_after": os.getloadavg(), "summary": (work / "tune.log").read_text(errors="replace").splitlines()[-9:]}


def _reference(encoder_dir: Path, label: str, poll_s: float = 10.0) -> dict[str, Any]:
    """The arm of an encoder tuned by another process: its report's phases and verdicts."""
    report = encoder_dir / "report.json"
    while not report.is_file():   # written last by `qswap tune run` (atomically)
        print(f"waiting for {report}", file=sys.stderr, flush=True)
        time.sleep(poll_s)
    rep = json.loads(report.read_text())
    tr = rep["training"]
    total = rep["wall_seconds_total"]
    return {"label": label, "encoder_dir": encoder_dir, "command": ["", "", "qswap", "tune", "run",
                                                                    *_config_args(rep)],
            "wall_seconds": total, "phases": rep["phases"], "report_total_seconds": total,
            "steps": tr["steps"], "seconds_per_step": tr.get("seconds_per_step"), "best_epoch": tr["best_epoch"],
            "stopped": tr["stopped"], "documents": rep["data"]["documents"], "splits": rep["data"]["splits"],
            "recipe": rep.get("recipe"), "query_runtime": rep.get("query_runtime"),
            "artifact_check": rep.get("artifact_check"), "guard_passed": rep["guard"]["passed"],
            "cpu_seconds": rep.get("cpu_seconds_total"),
            "guard": rep["guard"], "load_before": [float("nan")] * 3, "load_after": [float("nan")] * 3,
            "summary": [f"(run by another process; total = the run's own clock, {total:.0f} s)"]}


def _config_args(rep: dict[str, Any]) -> list[str]:
    cfg = rep.get("config", {})
    tr = cfg.get("train", {})
    return [f"--{k}={v}" for k, v in (("precision", tr.get("precision")), ("fused", tr.get("fused")),
                                      ("dropout", tr.get("dropout")), ("query-runtime", cfg.get("query_runtime")))]


def compare_encoders(beir: Path, index: Path, reference: Path, candidate: Path, langs: list[str],
                     label: str) -> dict[str, Any]:
    """The guard's record of ``candidate`` against ``reference`` (two tuned encoders) on every
    language's queries neither trained on: per-query nDCG@10, Wilcoxon, Holm over languages."""
    from qswap.encoders import load_base
    from qswap.guard.checks import guard_record, sentinel_check
    from qswap.index import open_index
    from qswap.tuning.beir_eval import BeirEvaluator
    from qswap.tuning.doc_cache import StoredEmbeddings
    from qswap.tuning.queries import FastQueries
    from qswap.tuning.config import SEEN_QUERIES

    base = load_base(device="cpu")
    stored = StoredEmbeddings.from_index(open_index(index, read_only=True, expected_space=base.space))
    seen: set[str] = set()
    for d in (reference, candidate):
        seen |= set(json.loads((d / SEEN_QUERIES).read_text())["ids"])
    # One runtime each: both runs may have written an encoder of the same name@version.
    tokens = base_tokens(base)
    runtimes = [FastQueries(base, tokens) for _ in range(2)]
    try:
        _, old = runtimes[0].tuned_encoder(reference)
        _, new = runtimes[1].tuned_encoder(candidate)
        ev = BeirEvaluator(base, new, progress=False, stored=stored, encode_base=old)
        checks = []
        for lang in langs:
            r = ev.pair(beir, lang, None, exclude_qids=seen)
            checks.append(sentinel_check(lang, r.base, r.tuned, against=label, lang=lang))
    finally:
        for fast in runtimes:
            fast.close()
    return guard_record(checks).to_json()


def base_tokens(base: Any) -> Any:
    """A token memo for ``base``'s queries."""
    from qswap.tuning.queries import QueryTokens
    return QueryTokens(base.tokenizer, base.spec.query_prefix)


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
    arms = [_reference(args.candidate, "default") if args.candidate is not None else _tune(args, tmp, "default", "")]
    res: dict[str, Any] = {**{k: v for k, v in arms[0].items() if k != "encoder_dir"},
                           "before_seconds": args.before, "before_label": args.before_label, "arms": []}
    if args.compare_args is not None:
        arms.append(_tune(args, tmp, args.compare_label, args.compare_args))
    elif args.reference is not None:
        arms.append(_reference(args.reference, args.compare_label))
    if len(arms) > 1:
        langs = [x for x in args.eval_langs.split(",") if x]
        res["quality_vs_compare"] = compare_encoders(args.beir, args.index, arms[1]["encoder_dir"],
                                                     arms[0]["encoder_dir"], langs, args.compare_label)
    res["arms"] = [{k: v for k, v in a.items() if k != "encoder_dir"} for a in arms]
    _write(w, res)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _write(w: ResultWriter, res: dict[str, Any]) -> None:
    arms = res["arms"]
    names = list(dict.fromkeys(k for a in arms for k in a["phases"]))
    rows = [[k, *(f"{a['phases'].get(k, 0):.0f}" for a in arms)] for k in names]
    rows.append(["other (process start, report, save)",
                 *(f"{a['wall_seconds'] - sum(a['phases'].values()):.0f}" for a in arms)])
    rows.append(["**total (process wall)**", *(f"**{a['wall_seconds']:.0f}**" for a in arms)])
    rows.append(["CPU seconds of the run (all threads)",
                 *(f"{a['cpu_seconds']:.0f}" if a.get("cpu_seconds") else "n/a" for a in arms)])
    rows.append(["training steps", *(str(a["steps"]) for a in arms)])
    rows.append(["seconds per step", *(f"{a['seconds_per_step']:.3f}" for a in arms)])
    rows.append(["load average before / after",
                 *(f"{a['load_before'][0]:.2f} / {a['load_after'][0]:.2f}" for a in arms)])
    if res["before_seconds"]:
        rows.append([res["before_label"], f"{res['before_seconds']:.0f}", *([""] * (len(arms) - 1))])
    met = res["wall_seconds"] <= BUDGET_S
    md = ""
    for a in arms:
        md += (f"**{a['label']}**: `{' '.join(a['command'][2:])}`\n\nrecipe settings used: "
               f"`{json.dumps((a.get('recipe') or {}).get('settings'))}`; query runtime `{a.get('query_runtime')}`\n\n")
    md += (f"{res['documents']:,} documents (from the index: none embedded), splits {res['splits']}; "
           f"best epoch {res['best_epoch']} (stopped by {res['stopped']}); guard "
           f"{'passed' if res['guard_passed'] else 'refused'}.\n\n"
           + md_table(["phase (seconds)", *(a["label"] for a in arms)], rows)
           + f"\nBudget: <= {BUDGET_S / 60:.0f} min: {'met' if met else '**missed**'}\n\n")
    if len(arms) > 1:
        md += f"Training steps/s: {arms[1]['seconds_per_step'] / arms[0]['seconds_per_step']:.2f}x of {arms[1]['label']}'s.\n\n"
    for a in arms:
        md += f"{a['label']}:\n\n```\n" + "\n".join(a["summary"]) + "\n```\n\n"
    q = res.get("quality_vs_compare")
    if q:
        qrows = [[c["name"], c["n"], f"{c['before']:.4f}", f"{c['after']:.4f}", f"{c['delta']:+.4f}",
                  f"{c['p_value']:.3g}", f"{c['p_holm']:.3g}", c["verdict"]] for c in q["checks"]]
        md += (f"### Quality: default vs {arms[1]['label']} (two tuned encoders, held-out queries)\n\n"
               + md_table(["language", "queries", f"nDCG@10 {arms[1]['label']}", "nDCG@10 default", "delta",
                           "Wilcoxon p", "Holm p", "verdict"], qrows)
               + f"\nNo language significantly worse: {'yes' if q['passed'] else '**no**'}.\n\n")
        for a in arms:
            own = [c for c in a["guard"]["checks"] if c["name"].endswith("(held-out test)")]
            md += "".join(f"- {a['label']}: {c['name']} vs base nDCG@10 {c['before']:.4f} -> {c['after']:.4f}, "
                          f"Holm p {c['p_holm']:.2g}, {c['verdict']}\n" for c in own)
    series = {a["label"]: [a["phases"].get(k, 0.0) for k in names] for a in arms}
    plot_bars(w.plot_path("phases.png"), names, series, ylabel="seconds",
              title=f"qswap tune run, {res['documents']:,} documents: "
                    + ", ".join(f"{a['label']} {a['wall_seconds'] / 60:.1f} min" for a in arms))
    w.write(res, md)
    print(md)

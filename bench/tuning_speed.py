"""Tuning speed: qswap's query-tower tuning against a sentence-transformers TripletLoss run.

Same triplets, same hardware, same batch (14), same learning rate (5e-8), same loss
(triplet, cosine distance, margin 0.1), same optimiser (AdamW, weight decay 0.01), dropout
on in both; each arm runs in its own fresh process, alternating (qswap, ST, ST, qswap...):

- **qswap**: ``qswap tune run`` (default method ``partial``: every transformer block
  trains, the embedding block is frozen; documents are embedded once by the frozen base and
  never again) with early stopping (``--patience`` idle epochs of ``--epoch-batches``);
- **sentence-transformers**: the model loaded from the same local directory, its
  ``losses.TripletLoss`` (``TripletDistanceMetric.COSINE``, margin 0.1) on
  (anchor, positive, negative) texts: all three go through the model with gradients every
  step, and every weight trains, as a plain ST fine-tune does. It runs in a plain PyTorch
  loop (ST's ``SentenceTransformerTrainer`` needs the ``datasets`` package, which is not
  installed; the Trainer only adds per-step overhead, so this flatters ST). One ST step
  costs tens of seconds on two cores, so ST runs ``--st-steps`` steps and its wall time to
  the step at which qswap stopped is extrapolated: its measured start-up + first step +
  (n - 1) x its mean later step (the first step is left out of its steps/s, which flatters
  it too).

Reported: training steps/s (per-step time: batch, tokenisation, forward, loss, backward,
optimiser step; validation excluded), wall time to the stopping point (process start to
exit, so model loading, qswap's one-off document embedding and its evaluation are in),
and the ratio per round. Data: triplets from the Debian benchmark (query = English short
description, positive = its package's long description, negative = another package of the
same Debian section).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qswap import DEFAULT_MODEL
from qswap.bench.results import ResultWriter, md_table, results_dir_for
from qswap.bench.stats import interleaved, ratio_summary, summarize
from qswap.bench import tuning_phases, tuning_step
from qswap.bench.plots import plot_bars
from qswap.errors import InvalidInputError

NAME = "tuning"
BATCH = 14
LR = 5e-8
MARGIN = 0.1
WEIGHT_DECAY = 0.01


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench tuning``."""
    p.add_argument("--model", default=None,
                   help="bundled name or model directory (default multilingual-e5-small; quick all-minilm-l6-v2)")
    p.add_argument("--samples", type=int, default=None, help="triplets (default 300; quick 60)")
    p.add_argument("--epoch-batches", type=int, default=None, help="qswap epoch length (default 20; quick 2)")
    p.add_argument("--max-epochs", type=int, default=None, help="qswap epochs at most (default 8; quick 2)")
    p.add_argument("--patience", type=int, default=None, help="qswap idle epochs before stopping (default 2; quick 1)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 2; quick 1)")
    p.add_argument("--st-steps", type=int, default=None,
                   help="sentence-transformers steps run (default 6; quick 2); its wall time to qswap's "
                        "stopping step is extrapolated from them")
    p.add_argument("--max-doc-chars", type=int, default=600, help="documents are cut to this many characters")
    tuning_phases.add_arguments(p)
    tuning_step.add_arguments(p)


def make_triplets(path: Path, n: int, seed: int = 0, max_doc_chars: int = 2000) -> dict[str, Any]:
    """Write ``n`` Debian triplets ``{"query", "pos": [doc], "neg": [doc of the same section]}``."""
    from qswap.beir import load_beir
    from qswap.bench.fixtures import debian_dir

    corpus, queries, qrels = load_beir(debian_dir(), "en", strict=False)
    by_section: dict[str, list[str]] = {}
    for did, (_, meta) in corpus.items():
        by_section.setdefault(meta.get("section", ""), []).append(did)
    rng = random.Random(seed)
    qids = sorted(queries)
    rng.shuffle(qids)
    rows = []
    for qid in qids:
        pos = sorted(qrels[qid])[0]
        section = corpus[pos][1].get("section", "")
        pool = by_section.get(section, [])
        if len(pool) < 2:
            continue
        neg = pos
        while neg in qrels[qid]:
            neg = pool[rng.randrange(len(pool))]
        rows.append({"query": queries[qid], "pos": [corpus[pos][0][:max_doc_chars]],
                     "neg": [corpus[neg][0][:max_doc_chars]]})
        if len(rows) >= n:
            break
    if len(rows) < n:
        raise InvalidInputError(f"only {len(rows)} triplets could be made", "use fewer --samples")
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    chars = [len(r["pos"][0]) for r in rows] + [len(r["neg"][0]) for r in rows]
    return {"triplets": len(rows), "doc_chars_mean": sum(chars) / len(chars), "max_doc_chars": max_doc_chars,
            "query_chars_mean": sum(len(r["query"]) for r in rows) / len(rows)}


# --------------------------------------------------------------------------- the ST arm (own process)


def st_arm(triplets: Path, model_dir: Path, steps: int, out: Path, seed: int = 0,
           query_prefix: str = "", document_prefix: str = "") -> dict[str, Any]:
    """Train a sentence-transformers model with its TripletLoss for ``steps`` steps; write timings."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.losses import TripletDistanceMetric, TripletLoss

    t_start = time.perf_counter()
    torch.manual_seed(seed)
    rows = [json.loads(line) for line in Path(triplets).read_text(encoding="utf-8").splitlines() if line.strip()]
    # The same training share as qswap's default split (80 %): only those rows are drawn.
    rows = rows[: max(BATCH, int(len(rows) * 0.8))]
    model = SentenceTransformer(str(model_dir), device="cpu")
    loss_fn = TripletLoss(model, distance_metric=TripletDistanceMetric.COSINE, triplet_margin=MARGIN)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    model.train()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(rows))
    pos = 0
    t_ready = time.perf_counter()
    step_s: list[float] = []
    losses: list[float] = []
    for _ in range(steps):
        s0 = time.perf_counter()
        if pos + BATCH > len(order):
            order, pos = rng.permutation(len(rows)), 0
        batch = [rows[i] for i in order[pos:pos + BATCH]]
        pos += BATCH
        feats = [model.tokenize([query_prefix + r["query"] for r in batch]),
                 model.tokenize([document_prefix + r["pos"][0] for r in batch]),
                 model.tokenize([document_prefix + r["neg"][0] for r in batch])]
        feats = [{k: v.to(model.device) if hasattr(v, "to") else v for k, v in f.items()} for f in feats]
        loss = loss_fn(feats, torch.zeros(BATCH))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_s.append(time.perf_counter() - s0)
        losses.append(float(loss.detach()))
    # The first step pays one-off costs (optimizer state, allocator warm-up): kept apart.
    timed = step_s[1:] or step_s
    res = {"steps": steps, "step_seconds": step_s, "first_step_seconds": step_s[0] if step_s else None,
           "seconds_per_step": sum(timed) / max(len(timed), 1),
           "train_seconds": sum(step_s), "setup_seconds": t_ready - t_start,
           "trainable_parameters": sum(p.numel() for p in params), "losses_first_last": [losses[0], losses[-1]]
           if losses else [], "max_seq_length": model.max_seq_length}
    Path(out).write_text(json.dumps(res))
    return res


def _st_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m qswap.bench.tuning_speed st-arm")
    p.add_argument("--triplets", type=Path, required=True)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--query-prefix", default="")
    p.add_argument("--document-prefix", default="")
    a = p.parse_args(argv)
    st_arm(a.triplets, a.model_dir, a.steps, a.out, query_prefix=a.query_prefix, document_prefix=a.document_prefix)
    return 0


# --------------------------------------------------------------------------- the benchmark


def _timed(cmd: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise InvalidInputError(f"benchmark arm failed ({r.returncode}): {' '.join(cmd)}\n{tail}", f"see {log}")
    return dt


def run(args: argparse.Namespace) -> int:
    """``qswap bench tuning``."""
    if args.e2e:
        return tuning_phases.run(args)
    if args.step:
        return tuning_step.run(args)
    from qswap.bench.fixtures import qswap_command
    from qswap.encoders.bundled import BUNDLED, resolve_bundled

    quick = bool(args.quick)
    model = args.model or ("all-minilm-l6-v2" if quick else DEFAULT_MODEL)
    n = args.samples or (60 if quick else 300)
    epoch_batches = args.epoch_batches or (2 if quick else 20)
    max_epochs = args.max_epochs or (2 if quick else 8)
    patience = args.patience or (1 if quick else 2)
    rounds = args.rounds or (1 if quick else 2)
    out = results_dir_for(NAME, quick, args.out)
    w = ResultWriter(NAME, out)
    tmp = out / "tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model_dir = resolve_bundled(model) if model in BUNDLED else Path(model)
    spec = json.loads((model_dir / "qswap_base.json").read_text()) if (model_dir / "qswap_base.json").exists() else {}
    qp, dp = spec.get("query_prefix", ""), spec.get("document_prefix", "")
    triplets = tmp / "triplets.jsonl"
    data = make_triplets(triplets, n, max_doc_chars=args.max_doc_chars)
    log = tmp / "arms.log"
    state: dict[str, Any] = {"qswap_steps": None, "i": 0}
    qswap_runs: list[dict[str, Any]] = []
    st_runs: list[dict[str, Any]] = []

    def qswap_arm() -> dict[str, Any]:
        state["i"] += 1
        enc = tmp / f"enc{state['i']}"
        cmd = qswap_command() + ["tune", "run", "--allow-identity", "--train", str(triplets), "--base", str(model), "--out", str(enc),
                                 "--batch-size", str(BATCH), "--lr", str(LR), "--margin", str(MARGIN),
                                 "--weight-decay", str(WEIGHT_DECAY), "--epoch-batches", str(epoch_batches),
                                 "--max-epochs", str(max_epochs), "--patience", str(patience),
                                 "--cache-dir", str(tmp / f"cache{state['i']}"), "--device", "cpu", "--quiet"]
        wall = _timed(cmd, log)
        rep = json.loads((enc / "report.json").read_text())
        tr = rep["training"]
        state["qswap_steps"] = state["qswap_steps"] or tr["steps"]
        r = {"wall_s": wall, "steps": tr["steps"], "seconds_per_step": tr["seconds_per_step"],
             "steps_per_s": 1.0 / tr["seconds_per_step"], "train_loop_s": tr["wall_seconds"],
             "stopped": tr["stopped"], "best_epoch": tr["best_epoch"], "epochs": len(tr["history"]) - 1,
             "in_process_total_s": rep.get("wall_seconds_total"), "command": " ".join(cmd),
             "documents": rep["data"].get("documents"), "kind": rep["encoder"]["kind"]}
        qswap_runs.append(r)
        print(f"qswap: {r['steps']} steps, {r['steps_per_s']:.2f} steps/s, wall {wall:.0f} s", file=sys.stderr)
        return r

    def st_arm_run() -> dict[str, Any]:
        steps = args.st_steps or (2 if quick else 6)
        state["i"] += 1
        res_path = tmp / f"st{state['i']}.json"
        cmd = [sys.executable, "-m", "qswap.bench.tuning_speed", "st-arm", "--triplets", str(triplets),
               "--model-dir", str(model_dir), "--steps", str(steps), "--out", str(res_path),
               "--query-prefix", qp, "--document-prefix", dp]
        wall = _timed(cmd, log)
        r = json.loads(res_path.read_text())
        # Wall time to the step qswap stopped at, had this run gone on: everything but the
        # training loop as measured, plus first step + (n - 1) x the mean later step.
        n_stop = state["qswap_steps"] or steps
        overhead = wall - r["train_seconds"]
        r.update(wall_measured_s=wall, steps_per_s=1.0 / r["seconds_per_step"], command=" ".join(cmd),
                 steps_to_stop=n_stop,
                 wall_s=overhead + r["first_step_seconds"] + (n_stop - 1) * r["seconds_per_step"])
        st_runs.append(r)
        print(f"sentence-transformers: {steps} steps, {r['steps_per_s']:.3f} steps/s, wall {wall:.0f} s "
              f"(to qswap's stopping step {n_stop}: {r['wall_s']:.0f} s)", file=sys.stderr)
        return r

    # qswap goes first: its stopping point sets the step count of the ST runs.
    interleaved({"qswap": qswap_arm, "sentence-transformers": st_arm_run}, rounds=rounds, warmup=0)
    sps = ratio_summary([r["steps_per_s"] for r in qswap_runs], [r["steps_per_s"] for r in st_runs])
    wall = ratio_summary([r["wall_s"] for r in st_runs], [r["wall_s"] for r in qswap_runs])
    res = {"model": model, "model_dir": str(model_dir), "data": data, "batch_size": BATCH, "lr": LR,
           "margin": MARGIN, "weight_decay": WEIGHT_DECAY, "epoch_batches": epoch_batches, "max_epochs": max_epochs,
           "patience": patience, "rounds": rounds, "qswap": qswap_runs, "sentence_transformers": st_runs,
           "steps_per_s_ratio_qswap_over_st": sps.to_dict(), "wall_ratio_st_over_qswap": wall.to_dict()}
    _write(w, res)
    if not quick:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {out}")
    return 0


def _write(w: ResultWriter, res: dict[str, Any]) -> None:
    q, s = res["qswap"], res["sentence_transformers"]
    med = lambda xs: summarize(xs, (50,))["p50"]  # noqa: E731
    plot_bars(w.plot_path("steps_per_s.png"), ["steps / s", "wall time to stop (min)"],
              {"qswap": [med([r["steps_per_s"] for r in q]), med([r["wall_s"] for r in q]) / 60],
               "sentence-transformers": [med([r["steps_per_s"] for r in s]), med([r["wall_s"] for r in s]) / 60]},
              ylabel="value", title=f"Tuning {res['model']}: batch {res['batch_size']}, lr {res['lr']:g}")
    rows = [["qswap tune run", f"{q[i]['steps_per_s']:.2f}", q[i]["steps"], f"{q[i]['wall_s']:.0f}",
             f"stopped by {q[i]['stopped']} after {q[i]['epochs']} epochs (best {q[i]['best_epoch']})"]
            for i in range(len(q))]
    rows += [["sentence-transformers TripletLoss", f"{s[i]['steps_per_s']:.3f}", s[i]["steps"],
              f"{s[i]['wall_s']:.0f} (to step {s[i]['steps_to_stop']}, extrapolated; ran {s[i]['wall_measured_s']:.0f})",
              f"{s[i]['trainable_parameters'] / 1e6:.0f}M trainable parameters, first step "
              f"{s[i]['first_step_seconds']:.1f} s"] for i in range(len(s))]
    r1, r2 = res["steps_per_s_ratio_qswap_over_st"], res["wall_ratio_st_over_qswap"]
    d = res["data"]
    md = (f"Model: {res['model']} ({res['model_dir']}). Data: {d['triplets']} Debian triplets (mean document "
          f"{d['doc_chars_mean']:.0f} characters, mean query {d['query_chars_mean']:.0f}); qswap splits them "
          "80/10/10 into train/validation/test (seeded), ST draws batches from 80 % of them (as many training triplets). Batch "
          f"{res['batch_size']}, lr {res['lr']:g}, AdamW (weight decay {res['weight_decay']}), triplet loss with "
          f"cosine distance and margin {res['margin']}. qswap: epochs of {res['epoch_batches']} batches, at most "
          f"{res['max_epochs']}, stop after {res['patience']} idle epochs. ST: {res['sentence_transformers'][0]['steps']} "
          "steps per run (first step excluded from its steps/s); its wall time to qswap's stopping step is "
          "extrapolated (start-up + first step + (n - 1) x mean step), not run. Documents cut to "
          f"{d['max_doc_chars']} characters.\n\n"
          f"**Steps/s, qswap / sentence-transformers: {r1['median']:.2f}x** (range {r1['min']:.2f}-{r1['max']:.2f}, "
          f"{r1['n']} rounds). **Wall time to the stopping point, ST / qswap: {r2['median']:.2f}x** (range "
          f"{r2['min']:.2f}-{r2['max']:.2f}); qswap's wall time includes embedding every document once and its "
          "evaluation, ST's only loading and training.\n\n"
          + md_table(["arm", "steps/s", "steps", "wall s to stop", "notes"], rows))
    w.write(res, md)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "st-arm":
        sys.exit(_st_main(sys.argv[2:]))
    print("usage: python -m qswap.bench.tuning_speed st-arm ... (or: qswap bench tuning)", file=sys.stderr)
    sys.exit(2)

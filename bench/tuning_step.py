"""``qswap bench tuning --step``: where the time of one training step goes, per option.

One process, the base model loaded once, real query texts (a BEIR directory's queries, or
the bundled Debian sample), document vectors random (a step only indexes into them). Each
arm is a tower and an optimiser built as :func:`qswap.tuning.trainer.train` builds them
(``TrainConfig``/``MethodConfig`` options); arms run interleaved, ``--step-rounds`` rounds of
``--step-steps`` steps each, so load on a shared machine spreads over all of them. Per step
the wall time is split into tokenisation, forward, loss + backward and optimiser step; the
first arm (today's settings) and the last are also profiled with ``torch.profiler`` (top
operators by self CPU time). Results: ``bench/results/tuning/step/``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qswap.bench.plots import plot_bars
from qswap.bench.results import ResultWriter, default_results_dir, md_table, results_dir_for

NAME = "tuning"
#: label -> (TrainConfig options, MethodConfig options, batch size); the first is today's settings.
ARMS: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {
    "today (fp32, dropout, foreach AdamW, per-step tokenisation)": ({}, {}, 14),
    "+ tokenised once": ({"pretokenised": True}, {}, 14),
    "+ fused AdamW": ({"pretokenised": True, "fused": True}, {}, 14),
    "+ no dropout": ({"pretokenised": True, "fused": True, "dropout": False}, {}, 14),
    "+ bf16 autocast": ({"pretokenised": True, "fused": True, "dropout": False, "precision": "bf16"}, {}, 14),
    "+ 6 lower blocks frozen": ({"pretokenised": True, "fused": True, "dropout": False, "precision": "bf16"},
                                {"freeze_blocks": 6}, 14),
    "+ batch 56 (per 14 queries)": ({"pretokenised": True, "fused": True, "dropout": False, "precision": "bf16"},
                                    {"freeze_blocks": 6}, 56),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the ``--step`` mode of ``qswap bench tuning``."""
    g = p.add_argument_group("--step: one training step, per option")
    g.add_argument("--step", action="store_true", help="time and profile training steps per option")
    g.add_argument("--step-steps", type=int, default=6, help="steps per arm and round (default 6)")
    g.add_argument("--step-rounds", type=int, default=3, help="interleaved rounds (default 3)")


def _queries(beir: Path | None) -> list[str]:
    from qswap.beir import read_queries
    from qswap.bench.fixtures import debian_dir
    return list(read_queries(beir if beir is not None else debian_dir(), "en").values())


class _Arm:
    def __init__(self, base: Any, label: str, opts: dict[str, Any], method: dict[str, Any], batch: int) -> None:
        from qswap.tuning.losses import build_loss
        from qswap.tuning.methods import MethodConfig, QueryTower
        from qswap.tuning.optim import make_optimizer
        self.label, self.batch = label, batch
        self.pretokenised = opts.get("pretokenised", False)
        self.precision = opts.get("precision", "fp32")
        self.tower = QueryTower(base, MethodConfig(kind="partial", **method))
        self.tower.model.train(opts.get("dropout", True))
        params = [p for _, p in self.tower.trainable_parameters()]
        self.opt = make_optimizer(params, "adamw", 5e-7, 0.01, True, fused=opts.get("fused", False))
        self.loss = build_loss("triplet")
        self.tokens = self.tower.tokens()
        self.times: dict[str, list[float]] = {"tokenise": [], "forward": [], "backward": [], "optimizer": [],
                                              "step": []}

    def step(self, texts: list[str], p: torch.Tensor, n: torch.Tensor, record: bool = True) -> None:
        from qswap.encoders import tokenize_batch
        from qswap.encoders.precision import autocast_context
        from qswap.tuning.losses import LossInput
        t0 = time.perf_counter()
        if self.pretokenised:
            ids, mask = self.tokens.batch(texts)
        else:
            ids, mask = tokenize_batch(self.tower.base.tokenizer, texts, self.tower.base.spec.query_prefix)
        t1 = time.perf_counter()
        with autocast_context(torch.device("cpu"), self.precision):
            q = self.tower.embed_ids(ids, mask)
        t2 = time.perf_counter()
        loss = self.loss(LossInput(q.float(), p, n, torch.ones(n.shape[:2], dtype=torch.bool), None))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        t3 = time.perf_counter()
        self.opt.step()
        t4 = time.perf_counter()
        if record:
            for k, v in zip(("tokenise", "forward", "backward", "optimizer", "step"),
                            (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                self.times[k].append(v)


def run(args: argparse.Namespace) -> int:
    """``qswap bench tuning --step``."""
    from qswap.encoders import load_base
    from torch.profiler import ProfilerActivity, profile

    out = results_dir_for(NAME, bool(args.quick), args.out or (None if args.quick else default_results_dir(NAME) / "step"))
    w = ResultWriter(NAME, out)
    base = load_base(args.model or "multilingual-e5-small", device="cpu")
    queries = _queries(getattr(args, "beir", None))
    rng = np.random.default_rng(0)
    docs = torch.nn.functional.normalize(torch.randn(4096, base.dim), dim=-1)
    steps, rounds = (2, 1) if args.quick else (args.step_steps, args.step_rounds)
    arms = [_Arm(base, label, o, m, b) for label, (o, m, b) in ARMS.items()]
    load_before = os.getloadavg()

    def batch(size: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        idx = rng.choice(len(queries), size, replace=False)
        return ([queries[i] for i in idx], docs[rng.integers(0, len(docs), size)],
                docs[rng.integers(0, len(docs), (size, 3))])

    for arm in arms:   # warm-up: first-call allocations, oneDNN kernel selection
        arm.step(*batch(arm.batch), record=False)
    for r in range(rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            for _ in range(steps):
                arm.step(*batch(arm.batch))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    profiles = {}
    for arm in (arms[0], arms[-1]):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(max(2, steps // 2)):
                arm.step(*batch(arm.batch), record=False)
        profiles[arm.label] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    res: dict[str, Any] = {"arms": [], "load_before": load_before, "load_after": os.getloadavg(),
                           "steps_per_arm": steps * rounds, "queries": len(queries), "profiles": profiles}
    for arm in arms:
        med = {k: statistics.median(v) for k, v in arm.times.items()}
        per14 = med["step"] * 14 / arm.batch
        res["arms"].append({"label": arm.label, "batch": arm.batch, "median_seconds": med,
                            "seconds_per_14_queries": per14, "trainable": arm.tower.parameter_counts()["trainable"]})
    _write(w, res)
    return 0


def _write(w: ResultWriter, res: dict[str, Any]) -> None:
    first = res["arms"][0]["seconds_per_14_queries"]
    rows = [[a["label"], a["batch"], f"{a['trainable'] / 1e6:.1f} M",
             *(f"{a['median_seconds'][k] * 1000:.0f}" for k in ("tokenise", "forward", "backward", "optimizer", "step")),
             f"{a['seconds_per_14_queries'] * 1000:.0f}", f"{first / a['seconds_per_14_queries']:.2f}x"]
            for a in res["arms"]]
    md = (f"Median over {res['steps_per_arm']} steps per arm (interleaved rounds); load average "
          f"{res['load_before'][0]:.2f} before, {res['load_after'][0]:.2f} after. Each row adds one option to "
          "the row above.\n\n"
          + md_table(["arm", "batch", "trainable", "tokenise ms", "forward ms", "loss+backward ms", "optimizer ms",
                      "step ms", "ms per 14 queries", "speed-up"], rows))
    for label, table in res["profiles"].items():
        md += f"\n\n### torch.profiler: {label}\n\n```\n{table}\n```\n"
    labels = [a["label"] for a in res["arms"]]
    series = {k: [a["median_seconds"][k] * 14 / a["batch"] for a in res["arms"]]
              for k in ("forward", "backward", "optimizer")}
    plot_bars(w.plot_path("step.png"), labels, series, ylabel="seconds per 14 queries", stacked=True,
              title="one training step of the query tower, per option")
    w.write(res, md)
    print(md)

"""``qswap bench peer``: qswap against Infinity, the peer a user would otherwise run, side by side.

Infinity (``infinity-emb``) is installed from the package index into its own virtualenv on
first use (:mod:`qswap.bench.infinity_peer`; reused when present, ``--infinity-venv``) and
serves the same weights on its fastest CPU engine (ONNX Runtime through optimum, its own graph
optimisation, mean pooling). Three scenarios, each with its own pair of servers:

- **one domain**: qswap with one LoRA encoder (rank 16) over the base vs Infinity serving that
  encoder merged into the base (the same function, one model);
- **four domains** (``--domains``): qswap with four LoRA encoders over one shared base vs
  Infinity serving the four merged models in one process, as it serves several models;
- **twenty domains**: the same with 20. One Infinity model costs about as much memory as the
  whole qswap server, so before it starts, Infinity's memory per model is measured (a server
  with one model, then two: :func:`qswap.bench.infinity_peer.model_cost`) and it loads as many
  of the merged models as fit in the memory available then, less a reserve for the rest of the
  machine (:func:`qswap.bench.infinity_peer.models_that_fit`). Where fewer than 20 fit, its
  requests go round-robin over the ones it holds, and the results say where it stopped and why:
  fewer models, fuller batches per model, so its figure is, if anything, in its favour.

Before timing, agreement is checked: for every domain the same query texts are embedded by both
servers (qswap adds the model's ``"query: "`` prefix itself; Infinity adds none, so it is sent
``"query: " + text``) and the minimum cosine must reach 0.9999. Then, at each concurrency level,
three arms run alternately (order reversed every round): qswap's search route (``POST
/v1/search``, k=10, which also searches the index), qswap's OpenAI-compatible ``POST
/v1/embeddings`` and Infinity's ``POST /embeddings`` (one query per call, float JSON on both
embeddings routes), with the raw asyncio keep-alive client in closed loop, requests spread
round-robin over the domains. Reported per point: QPS, p50, p99, failures and the load average;
per scenario: both servers' RSS. ``--no-infinity`` runs qswap's arms alone.

Timing starts once qswap builds nothing more in the background
(:func:`qswap.bench.fixtures.warm_until_settled`: warm-up traffic at the highest concurrency, then
``GET /readyz`` until its ``warming`` list is empty, again until a round starts no build): the
segment graph and the mixed-batch session are built only once batches mix encoders. A timing
during which a qswap server still started one is run again once it is built
(:func:`qswap.bench.fixtures.time_settled`). With one domain, or as many as ``--hot-encoders``
(default: the server's, one), each encoder serves a fair share of the rows, so the shared backend makes
every one *hot* (:mod:`qswap.encoders.runtime.hot`: its rows run on a merged graph of their own):
timing starts once they are. ``--hot-off-arm`` adds a fourth arm in those scenarios, qswap's
search route on a second server started with ``--hot-encoders 0``, to show what hot encoders
change side by side.
``--mix-arm MODE`` adds, in the scenarios of several domains, qswap's search route on a second
server started with ``--mixed-batches MODE`` (how a batch that mixes encoders runs), to compare
that setting with the default side by side. ``--scenarios`` picks the scenarios to run (default ``one,many``; ``twenty`` on request).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from qswap.bench.load_options import (ByMode, LoadDefaults, LoadOptions, RunDirs, add_load_arguments, load_point,
                                      warm_up)
from qswap.bench.loadgen import Request
from qswap.bench.processes import http_json
from qswap.encoders.runtime.hot import DEFAULT_HOT

NAME = "peer"
LOAD = LoadDefaults(levels=ByMode((1, 8, 32), (1, 4)), seconds=ByMode(15.0, 1.0), requests=ByMode(1_000_000, 40),
                    rounds=ByMode(2, 1), rounds_help="alternating rounds per arm and level")
DOMAINS = ByMode(4, 2)
#: Domains of the ``twenty`` scenario (``--quick``: a few, for the mechanics).
TWENTY = ByMode(20, 3)
RANK = 16
#: Searches sent before timing a scenario whose every encoder becomes hot (no more domains than
#: qswap.encoders.runtime.hot.DEFAULT_HOT): more than a hot-encoder window (HOT_WINDOW_ROWS), so
#: that they run merged.
HOT_WARM_ROWS = 640
#: Minimum cosine between the two servers' query embeddings for the comparison to count.
AGREEMENT_BAR = 0.9999
#: QPS ratio qswap / Infinity asked for (one domain, with p99 <= Infinity's; several domains).
TARGETS = {"one": 1.2, "many": 2.0, "twenty": 3.0}
#: Scenarios whose target also asks for a p99 no higher than Infinity's.
P99_TARGETS = ("one", "twenty")
HOT_OFF = "qswap search, hot off"
MIX_ARM = "qswap search, mix="   # + the --mix-arm setting
ARMS = ("qswap search", "qswap embeddings", HOT_OFF, "infinity embeddings")


def _arms(present: Any) -> list[str]:
    """The arms of a level in report order: :data:`ARMS` present, then a ``--mix-arm`` one."""
    return [a for a in ARMS if a in present] + sorted(a for a in present if a.startswith(MIX_ARM))
SCENARIOS = ("one", "many", "twenty")
DEFAULT_SCENARIOS = ("one", "many")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench peer``."""
    from qswap.bench.fixtures import MODEL
    from qswap.bench.infinity_peer import venv_dir
    from qswap.bench.load_options import add_model_argument
    add_load_arguments(p, LOAD)
    p.add_argument("--domains", type=int, default=None, help=f"domains of the second scenario ({DOMAINS.describe()})")
    p.add_argument("--infinity-venv", type=Path, default=None,
                   help=f"Infinity's virtualenv (default {venv_dir()}; installed there when missing)")
    p.add_argument("--backend", choices=("shared", "onnx"), default="shared",
                   help="qswap's query backend (default shared, the server's default: one session, adapters as "
                        "inputs; onnx: one merged export per encoder); timing starts once every encoder runs on it")
    p.add_argument("--infinity-memory", type=float, default=None, metavar="MIB",
                   help="memory Infinity's models may take, in MiB (default: what is available when it starts, "
                        "less a reserve for the rest of the machine); it loads as many as fit")
    p.add_argument("--hot-encoders", type=int, default=DEFAULT_HOT, metavar="N",
                   help=f"qswap's --hot-encoders (default {DEFAULT_HOT}, the server's); a scenario of at most N "
                        "domains waits until every encoder runs hot before timing")
    p.add_argument("--hot-off-arm", action="store_true",
                   help="one domain, and several up to --hot-encoders: also time qswap's search on a "
                        "second server with --hot-encoders 0")
    p.add_argument("--mix-arm", choices=("auto", "groups", "segments"), default=None,
                   help="several domains: also time qswap's search on a second server with --mixed-batches MODE")
    p.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS),
                   help="comma-separated scenarios to run: one (one domain), many (--domains), twenty "
                        f"(domains: {TWENTY.describe()}; Infinity loads as many merged models as fit in memory) "
                        f"(default {','.join(DEFAULT_SCENARIOS)})")
    p.add_argument("--no-infinity", action="store_true",
                   help="run qswap's arms only (where Infinity cannot be installed)")
    add_model_argument(p, MODEL)


def _vectors(url: str, texts: list[str], model: str) -> np.ndarray:
    """Float embeddings of ``texts`` from an OpenAI-style embeddings ``url``."""
    status, body = http_json("POST", url, {"input": texts, "model": model, "encoding_format": "float"})
    if status != 200:
        raise RuntimeError(f"{url} answered {status}: {str(body)[:200]}")
    return np.asarray([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])], dtype=np.float64)


def agreement(qs_url: str, inf_url: str, texts: list[str], domains: list[str], prefix: str) -> dict[str, Any]:
    """Cosine between qswap's and Infinity's embeddings of the same queries, per domain.

    Args:
        qs_url: qswap's ``/v1/embeddings`` URL (encoders ``<domain>@1``; it adds ``prefix`` itself).
        inf_url: Infinity's ``/embeddings`` URL (models ``<domain>``; sent ``prefix + text``).
        texts: query texts.
        domains: domain names.
        prefix: the model's query prefix.

    Returns:
        ``{"queries", "min_cosine", "per_domain": {domain: min cosine}, "passes"}``.
    """
    per: dict[str, float] = {}
    for d in domains:
        a = _vectors(qs_url, texts, f"{d}@1")
        b = _vectors(inf_url, [prefix + t for t in texts], d)
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        per[d] = float(cos.min())
    low = min(per.values())
    return {"queries": len(texts), "min_cosine": low, "per_domain": per, "bar": AGREEMENT_BAR,
            "passes": low >= AGREEMENT_BAR}


@dataclass
class _Infinity:
    """Infinity's side of a run: its python, where its exports live, what makes them, and its
    memory per model once measured (:func:`qswap.bench.infinity_peer.model_cost`, once a run)."""

    py: Path
    enc_root: Path
    model: str
    memory: int | None = None   # bytes its models may take (None: what is available, less a reserve)
    root: Path = field(init=False)
    cost: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        from qswap.bench.fixtures import cache_dir
        self.root = cache_dir() / f"infinity-{self.enc_root.name}"

    def export(self, domains: list[str]) -> None:
        """Each domain's merged model, exported for Infinity by optimum (cached; the base is
        loaded only when one is missing)."""
        from qswap.bench.fixtures import load_space_base, merged_models
        from qswap.bench.infinity_peer import export_onnx, exported
        todo = [d for d in domains if not exported(self.root, d)]
        if not todo:
            return
        base = load_space_base(self.model)
        merged = merged_models(base, self.enc_root, [(d, "1") for d in todo], onnx=False)
        del base
        for d in todo:
            why = export_onnx(self.py, merged[d], self.root, d)
            if why:
                raise RuntimeError(why)

    def plan(self, domains: list[str], texts: list[str], tmp: Path) -> tuple[list[str], dict[str, Any]]:
        """The domains Infinity serves: all of them, or as many as fit in memory now (exported)."""
        from qswap.bench.infinity_peer import model_cost, models_that_fit
        from qswap.bench.processes import available_memory_bytes
        if len(domains) < 2:
            self.export(domains)
            return domains, {"served": len(domains), "of": len(domains)}
        self.export(domains[:2])
        if self.cost is None:
            self.cost = model_cost(self.py, self.root, domains[:2], texts, tmp)
        def fit() -> tuple[int, str]:
            if self.memory is not None:
                return models_that_fit(len(domains), self.cost, self.memory, reserve=0)
            return models_that_fit(len(domains), self.cost, available_memory_bytes())
        k, why = fit()
        if k >= 2:
            self.export(domains[:k])
            k2, why2 = fit()   # what the exports left
            if k2 < k:
                k, why = k2, why2
        facts = {"served": k, "of": len(domains), "cost": self.cost, **({"why": why} if why else {})}
        if why:
            print(f"Infinity: {why}", file=sys.stderr)
        return domains[:k], facts


def _scenario(label: str, n_dom: int, *, opts: LoadOptions, work: Any, idx_dir: Path, enc_root: Path,
              model: str, backend: str, infinity: _Infinity | None, prefix: str,
              tmp: Path, hot_off_arm: bool = False, mix_arm: str | None = None,
              hot_slots: int = DEFAULT_HOT) -> dict[str, Any]:
    """Start both servers for ``n_dom`` domains, check agreement, measure every arm at every level."""
    from qswap.bench.fixtures import (embedding_requests, qswap_server, register, search_requests, time_settled,
                                      wait_for_runtime, warm_until_settled)
    from qswap.bench.infinity_peer import server_command, server_env
    from qswap.bench.processes import ServerProcess, free_port
    from qswap.bench.stats import interleaved

    domains = [f"d{i}" for i in range(n_dom)]
    keys = [f"{d}@1" for d in domains]
    out: dict[str, Any] = {"label": label, "domains": n_dom, "levels": {}}
    top = max(opts.levels)
    warm_n = opts.settle_requests()
    with ExitStack() as stack:
        qs = stack.enter_context(qswap_server(idx_dir, enc_root, tmp / f"state-{n_dom}", tmp / f"qswap-{n_dom}.log",
                                              model=model, extra=["--backend", backend,
                                                                         "--hot-encoders", str(hot_slots)]))
        for d in domains:
            register(qs, f"{d}-1")
        out["qswap_runtime_wait_s"] = wait_for_runtime(qs, ["base", *keys],
                                                       "onnx-shared" if backend == "shared" else backend)
        arms: dict[str, tuple[int, Callable[[int], Request]]] = {
            "qswap search": (qs.port, search_requests(work.queries, keys)),
            "qswap embeddings": (qs.port, embedding_requests(work.queries, keys))}
        servers = {"qswap": {"command": qs.command, "start_s": qs.start_seconds}}
        qswaps = [qs]   # the qswap servers timed: none may build while timing (time_settled)
        hot = 0 < n_dom <= hot_slots and backend == "shared"
        if hot:   # each encoder serves a fair share of the rows: it runs merged once a window of rows says so
            warm_up(qs.port, arms["qswap search"][1], concurrency=4, requests=HOT_WARM_ROWS, duration_s=120)
            out["qswap_hot_wait_s"] = wait_for_runtime(qs, keys, "onnx")
        # Both routes, at the highest level: every batch shape the timed runs make has come up.
        out["qswap_settled"] = {name: warm_until_settled(qs, make, concurrency=top, requests=warm_n)
                                for name, (_, make) in arms.items()}
        if hot and hot_off_arm:
            off = stack.enter_context(qswap_server(idx_dir, enc_root, tmp / "state-hot-off", tmp / "qswap-hot-off.log",
                                                   model=model, extra=["--backend", backend, "--hot-encoders", "0"]))
            for d in domains:
                register(off, f"{d}-1")
            wait_for_runtime(off, ["base", *keys], "onnx-shared")
            arms[HOT_OFF] = (off.port, search_requests(work.queries, keys))
            servers["qswap, hot off"] = {"command": off.command, "start_s": off.start_seconds}
            qswaps.append(off)
            warm_until_settled(off, arms[HOT_OFF][1], concurrency=top, requests=warm_n)
        if mix_arm is not None and n_dom > 1:
            mixed = stack.enter_context(qswap_server(idx_dir, enc_root, tmp / f"state-mix-{n_dom}",
                                                     tmp / f"qswap-mix-{n_dom}.log", model=model,
                                                     extra=["--backend", backend, "--mixed-batches", mix_arm,
                                                            "--hot-encoders", str(hot_slots)]))
            for d in domains:
                register(mixed, f"{d}-1")
            wait_for_runtime(mixed, ["base", *keys], "onnx-shared" if backend == "shared" else backend)
            name = MIX_ARM + mix_arm
            arms[name] = (mixed.port, search_requests(work.queries, keys))
            servers[f"qswap, mix={mix_arm}"] = {"command": mixed.command, "start_s": mixed.start_seconds}
            qswaps.append(mixed)
            warm_until_settled(mixed, arms[name][1], concurrency=top, requests=warm_n)
        inf, served = None, []
        if infinity is not None:
            try:
                served, out["infinity_models"] = infinity.plan(domains, [prefix + q for q in work.queries[:32]], tmp)
            except RuntimeError as e:   # an export or the memory probe failed: qswap's arms run alone
                out["infinity_models"] = {"served": 0, "of": n_dom, "why": str(e)}
                print(f"{label}: Infinity skipped: {e}", file=sys.stderr)
        if infinity is not None and served:
            port = free_port()
            inf = stack.enter_context(ServerProcess(server_command(infinity.py, served, port), port,
                                                    ready_path="/health", log_path=tmp / f"infinity-{n_dom}.log",
                                                    env=server_env(infinity.root), cwd=infinity.root,
                                                    start_timeout_s=600))
            servers["infinity"] = {"command": inf.command, "start_s": inf.start_seconds}
            out["agreement"] = agreement(qs.url("/v1/embeddings"), inf.url("/embeddings"), work.queries[:32],
                                         served, prefix)
            print(f"{label}: agreement min cosine {out['agreement']['min_cosine']:.7f}", file=sys.stderr)
            arms["infinity embeddings"] = (inf.port, embedding_requests(work.queries, served, prefix))
            warm = warm_up(inf.port, arms["infinity embeddings"][1], concurrency=4, requests=warm_n, duration_s=60)
            if warm.failed:
                raise RuntimeError(f"{label}: warm-up of Infinity failed: {warm.errors()} {warm.statuses()}")
        out["servers"] = servers

        def time_levels() -> dict[str, Any]:
            levels = {}
            for c in opts.levels:
                got = interleaved({a: (lambda p=p, mk=mk, c=c: load_point(opts.run(p, mk, c)))
                                   for a, (p, mk) in arms.items()}, rounds=opts.rounds, warmup=0)
                levels[str(c)] = got
                print(f"{label} c={c}: " + ", ".join(f"{a} {[round(x['qps'], 1) for x in v]}/s p99 "
                                                     f"{[round(x['p99_ms']) for x in v]} ms" for a, v in got.items()),
                      file=sys.stderr)
            return levels

        # Nothing may be built while timing: the figures are the settled servers'.
        out["levels"], settled = time_settled(qswaps, time_levels)
        out["qswap_retimed"], out["qswap_built_during_timing"] = settled["retimed"], settled["built_during"]
        out["qswap_retimed_for"] = settled["thrown_for"]
        out["qswap_warming_after"] = http_json("GET", qs.url("/readyz"))[1].get("warming", [])
        out["rss_bytes"] = {"qswap": qs.rss(), **({"infinity": inf.rss()} if inf is not None else {}),
                            **({"qswap_hot_off": off.rss()} if hot and hot_off_arm else {})}
    return out


def run(args: argparse.Namespace) -> int:
    """``qswap bench peer``."""
    from qswap.bench.fixtures import index_meta, load_space_base, load_workload, lora_encoders, stamped_index
    from qswap.bench.infinity_peer import ensure_venv

    opts = LoadOptions.from_args(args, LOAD)
    n_many = args.domains or DOMAINS.pick(opts.quick)
    bad = [t for t in args.scenarios.split(",") if t.strip() and t.strip() not in SCENARIOS]
    if bad or not args.scenarios.strip():
        print(f"qswap bench peer: unknown scenario {','.join(bad) or '(none)'}: use {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2
    if n_many < 2:
        print("qswap bench peer: --domains must be at least 2 (the second scenario serves several domains)",
              file=sys.stderr)
        return 2
    wanted = [t.strip() for t in args.scenarios.split(",") if t.strip()]
    counts = {"one": 1, "many": n_many, "twenty": TWENTY.pick(opts.quick)}
    dirs = RunDirs.create(NAME, opts.quick, args.out)
    work = load_workload(opts.quick)
    base = load_space_base(args.model)
    prefix = base.spec.query_prefix
    idx_dir, _, _ = stamped_index(work, base, tag="default")
    keys = [(f"d{i}", "1") for i in range(max(counts[t] for t in wanted))]
    enc_root = lora_encoders(base, keys, rank=RANK, tag="peer")
    del base
    res: dict[str, Any] = {"workload": work.source, "index": index_meta(idx_dir), "model": args.model,
                           "encoders": f"random LoRA adapters, rank {RANK}, all dense layers", "levels": opts.levels,
                           "seconds_per_run": opts.seconds, "max_requests_per_run": opts.requests,
                           "rounds": opts.rounds, "query_prefix": prefix, "targets": TARGETS,
                           "qswap_backend": args.backend, "mix_arm": args.mix_arm}
    infinity = None
    if args.no_infinity:
        res["infinity"] = {"skipped": "--no-infinity"}
    else:
        py, why = ensure_venv(dirs.tmp / "pip.log", args.infinity_venv)
        if py is not None:
            infinity = _Infinity(py, enc_root, args.model,
                                 None if args.infinity_memory is None else int(args.infinity_memory * 2 ** 20))
            try:
                infinity.export(["d0"])
            except RuntimeError as e:
                why, infinity = str(e), None
        if why:
            res["infinity"] = {"skipped": why}
            print(f"qswap bench peer: Infinity skipped: {why}", file=sys.stderr)
        else:
            import subprocess
            v = subprocess.run([str(py), "-c", "import infinity_emb, onnxruntime; print(infinity_emb.__version__, "
                                "onnxruntime.__version__)"], capture_output=True, text=True).stdout.split()
            res["infinity"] = {"version": v[0] if v else None, "onnxruntime": v[1] if len(v) > 1 else None,
                               "engine": "optimum (ONNX Runtime, Infinity's graph optimisation)",
                               "pooling": "mean", "models": "each domain's LoRA merged into the base, optimum export"}
    res["scenarios"] = {}
    for tag in SCENARIOS:
        if tag not in wanted:
            continue
        n = counts[tag]
        label = "one domain" if n == 1 else f"{n} domains"
        res["scenarios"][tag] = _scenario(label, n, opts=opts, work=work, idx_dir=idx_dir, enc_root=enc_root,
                                          model=args.model, backend=args.backend, infinity=infinity,
                                          prefix=prefix, tmp=dirs.tmp, hot_off_arm=args.hot_off_arm,
                                          mix_arm=args.mix_arm, hot_slots=args.hot_encoders)
    _summarise(res)
    _write(dirs, res)
    dirs.clean_scratch()
    print(f"wrote {dirs.out}")
    return 0


def _median(xs: list[float]) -> float:
    from qswap.bench.stats import percentile
    return percentile(xs, 50)


def _summarise(res: dict[str, Any]) -> None:
    """Per scenario, level and qswap route: QPS and p99 ratios against Infinity, and the target."""
    from qswap.bench.stats import ratio_summary
    for tag, sc in res["scenarios"].items():
        sc["vs_infinity"] = {}
        for c, arms in sc["levels"].items():
            if HOT_OFF in arms:   # what hot encoders change: the same route, hot on / off
                sc.setdefault("hot_over_off", {})[c] = ratio_summary([x["qps"] for x in arms["qswap search"]],
                                                                     [x["qps"] for x in arms[HOT_OFF]]).to_dict()
            for a in _arms(arms):   # what --mixed-batches changes: the same route, that setting / the default
                if a.startswith(MIX_ARM):
                    sc.setdefault("mix_over_default", {})[c] = ratio_summary(
                        [x["qps"] for x in arms[a]], [x["qps"] for x in arms["qswap search"]]).to_dict()
            inf = arms.get("infinity embeddings")
            if inf is None:
                continue
            per = {}
            for route in _arms(arms):
                if route == "infinity embeddings":
                    continue
                q = arms[route]
                qps = ratio_summary([x["qps"] for x in q], [x["qps"] for x in inf]).to_dict()
                p99 = _median([x["p99_ms"] for x in q]) / _median([x["p99_ms"] for x in inf])
                met = qps["median"] >= TARGETS[tag] and (tag not in P99_TARGETS or p99 <= 1.0)
                per[route] = {"qps_ratio": qps, "p99_ratio_qswap_over_infinity": p99, "target_met": met}
            sc["vs_infinity"][c] = per


def _write(dirs: RunDirs, res: dict[str, Any]) -> None:
    from qswap.bench.plots import plot_lines
    from qswap.bench.results import md_table

    w, levels = dirs.writer, res["levels"]
    series, p99s = {}, {}
    for sc in res["scenarios"].values():
        for a in _arms(sc["levels"][str(levels[0])]):
            series[f"{sc['label']}: {a}"] = [_median([x["qps"] for x in sc["levels"][str(c)][a]]) for c in levels]
            p99s[f"{sc['label']}: {a}"] = [_median([x["p99_ms"] for x in sc["levels"][str(c)][a]]) for c in levels]
    plot_lines(w.plot_path("qps.png"), levels, series, xlabel="concurrent connections", ylabel="requests / s",
               title="qswap vs Infinity, same weights (median over rounds)", logx=True)
    plot_lines(w.plot_path("p99.png"), levels, p99s, xlabel="concurrent connections", ylabel="p99 latency (ms)",
               title="p99 latency (median over rounds)", logx=True, logy=True)
    mib = 2.0 ** 20
    rows, goals, mem, agree, stops = [], [], [], [], []
    for tag, sc in res["scenarios"].items():
        for c in levels:
            arms = sc["levels"][str(c)]
            for a in _arms(arms):
                pts = arms[a]
                vs = sc.get("vs_infinity", {}).get(str(c), {}).get(a)
                rows.append([sc["label"], c, a, _median([x["qps"] for x in pts]),
                             _median([x["p50_ms"] for x in pts]), _median([x["p99_ms"] for x in pts]),
                             f"**{vs['qps_ratio']['median']:.2f}x** ({vs['qps_ratio']['min']:.2f}-"
                             f"{vs['qps_ratio']['max']:.2f})" if vs else "",
                             f"{vs['p99_ratio_qswap_over_infinity']:.2f}x" if vs else "",
                             sum(x["failed"] for x in pts),
                             "/".join(f"{x['loadavg'][0]:.1f}" for x in pts if x["loadavg"])])
            for a, vs in sc.get("vs_infinity", {}).get(str(c), {}).items():
                if a == HOT_OFF or a.startswith(MIX_ARM):
                    continue   # a comparison arm, not the product's figure
                want = f">= {TARGETS[tag]}x QPS" + (" and p99 <= Infinity's" if tag in P99_TARGETS else "")
                goals.append(f"- {sc['label']}, c={c}, {a}: {vs['qps_ratio']['median']:.2f}x QPS, p99 "
                             f"{vs['p99_ratio_qswap_over_infinity']:.2f}x ({want}: "
                             f"{'met' if vs['target_met'] else '**missed**'})")
        for c, r in sc.get("hot_over_off", {}).items():
            goals.append(f"- {sc['label']}, c={c}: qswap search, hot encoder on / off: {r['median']:.2f}x QPS "
                         f"({r['min']:.2f}-{r['max']:.2f}; not a target)")
        for c, r in sc.get("mix_over_default", {}).items():
            goals.append(f"- {sc['label']}, c={c}: qswap search, --mixed-batches {res['mix_arm']} / the default: "
                         f"{r['median']:.2f}x QPS ({r['min']:.2f}-{r['max']:.2f}; not a target)")
        im = sc.get("infinity_models", {})
        if im.get("why"):
            stops.append(f"- {sc['label']}: Infinity served {im['served']} of the {im['of']} merged models "
                         f"({'its requests round-robin over those' if im['served'] else 'no row'}): {im['why']}.")
        rss = sc["rss_bytes"]
        mem.append([sc["label"], rss["qswap"] / mib, rss["infinity"] / mib if "infinity" in rss else "",
                    f"{im['served']} of {im['of']}" if im else ""])
        if "qswap_hot_off" in rss:   # the same encoders on a server with --hot-encoders 0: what hot sessions cost
            mem.append([f"{sc['label']}, qswap hot off", rss["qswap_hot_off"] / mib, "", ""])
        if "agreement" in sc:
            g = sc["agreement"]
            agree.append(f"{sc['label']}: min cosine {g['min_cosine']:.7f} over {g['queries']} queries x "
                         f"{sc['domains']} domain(s) ({'passes' if g['passes'] else '**fails**'} {g['bar']})")
    inf = res["infinity"]
    head = (f"Infinity skipped: {inf['skipped']}." if "skipped" in inf else
            f"Infinity {inf['version']} (onnxruntime {inf['onnxruntime']}), engine {inf['engine']}, {inf['pooling']} "
            f"pooling; models: {inf['models']}.") + " qswap: " + (
        "its default backend (one shared ONNX Runtime session, adapters bound per run)"
        if res["qswap_backend"] == "shared" else "`--backend onnx` (one merged, fused ONNX export per encoder)") + (
        f"; encoders: {res['encoders']}." + "".join(
            f" {sc['label']}: every encoder ran hot (its own merged graph) {sc['qswap_hot_wait_s']:.1f} s after "
            f"the warm-up, before timing." for sc in res["scenarios"].values() if "qswap_hot_wait_s" in sc) + "".join(
            f" {sc['label']}: qswap built {', '.join(b)} after its warm-up traffic; timing began once done."
            for sc in res["scenarios"].values()
            if (b := sorted({k for r in sc.get("qswap_settled", {}).values() for k in r["waited_for"]}))) + "".join(
            f" {sc['label']}: a timing during which qswap started a build was thrown away and run again"
            f" ({sc['qswap_retimed']}x; built: "
            f"{'; '.join(', '.join(k) for k in sc.get('qswap_retimed_for', [])) or 'not recorded'})."
            for sc in res["scenarios"].values() if sc.get("qswap_retimed")) + "".join(
            f" **{sc['label']}: qswap was still building during the last timing.**"
            for sc in res["scenarios"].values() if sc.get("qswap_built_during_timing")) + "".join(
            f" **{sc['label']}: qswap was building {', '.join(sc['qswap_warming_after'])} at the end of timing.**"
            for sc in res["scenarios"].values() if sc.get("qswap_warming_after")))
    md = (f"{head}\n\nWorkload: {res['workload']}; search over {res['index']['documents']:,} documents (k=10). "
          f"One query per call; requests round-robin over the domains; arms alternate at each level "
          f"({res['rounds']} round(s), order reversed every round), each run at most {res['seconds_per_run']:g} s "
          f"or {res['max_requests_per_run']:,} requests, closed loop, keep-alive, on 127.0.0.1. QPS, p50 and p99 are "
          "medians over rounds; ratios are per round pair (median, range); load = 1-minute load average at the "
          "end of each round's run.\n\n"
          + ("Agreement (query embeddings, same prefix, mean pooling, L2-normalised): " + "; ".join(agree) + ".\n\n"
             if agree else "")
          + ("Where Infinity stopped (memory):\n\n" + "\n".join(stops) + "\n\n" if stops else "")
          + ("Targets:\n\n" + "\n".join(goals) + "\n\n" if goals else "")
          + md_table(["scenario", "conc.", "arm", "QPS", "p50 ms", "p99 ms", "QPS / Infinity (range)",
                      "p99 / Infinity", "failed", "load"], rows)
          + "\n### Memory (RSS at the end of each scenario, MiB)\n\n"
          + md_table(["scenario", "qswap", "Infinity", "Infinity's models"], mem)
          + ("\n### The serving loop's profile\n\nWhere the one-domain server's interpreter spends its time under "
             "load, before and after the last changes to the serving loop: [profile.md](profile.md).\n"
             if (dirs.out / "profile.md").exists() else ""))
    print(md)
    w.write(res, md)

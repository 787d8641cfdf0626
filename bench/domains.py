"""``qswap bench domains``: one query encoder per domain over one frozen index, served at once.

The product's premise, measured on real data (the Debian package-descriptions set; domains
are Debian sections, see :mod:`qswap.bench.domains_data` for how they are chosen and split):

1. one index of the whole corpus (``qswap index build``: the document tower runs once);
2. per domain and training size (the learning curve, ``--sizes``), an encoder tuned by
   ``qswap tune run`` with the default recipe on that domain's training queries only, and a
   **general** encoder tuned the same way on the union of the domains' training sets of that
   size (the same labelled queries per domain, the same recipe);
3. sentinels per domain and language from the domain's held-out queries; one ``qswap serve``
   (uvicorn) with those sentinels; every encoder registered through the guard (``wait``: a
   refused one is recorded, then registered with ``force`` so it can be measured); each
   domain's alias switched to its encoder of the largest size;
4. every ranking fetched over HTTP (``/v1/search``; a domain's own encoder through its alias):
   nDCG@10 (:func:`qswap.guard.evaluation.ndcg_at_10`) on each domain's held-out queries in
   each language, encoder x domain, paired Wilcoxon signed-rank with Holm
   (:mod:`qswap.guard.stats`, the guard's test);
5. latency of mixed traffic (all domains round-robin through their aliases) against the base
   alone on the same server, arms alternated;
6. interleaving against an A/B test on click-through at a fixed power, per domain encoder, on
   the served rankings (:mod:`qswap.bench.domains_power`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qswap.bench.domains_data import DomainData, load_domains, write_corpus, write_subset
from qswap.bench.domains_power import fixed_power
from qswap.bench.domains_report import heatmap, latency_markdown, learning_curve_plot, markdown
from qswap.bench.loadgen import Request, run_load_sync
from qswap.bench.processes import ServerProcess, free_port, http_json
from qswap.bench.results import ResultWriter, results_dir_for
from qswap.bench.stats import summarize
from qswap.errors import InvalidInputError
from qswap.guard.evaluation import ndcg_at_10
from qswap.guard.stats import holm, paired_compare

K = 10
BASE = "base"
GENERAL = "general"
MIN_SENTINEL = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--beir", type=Path, help="Debian BEIR set (default: `qswap bench data debian`'s, built once)")
    p.add_argument("--domains", default="science,net,admin,devel", help="Debian sections used as domains")
    p.add_argument("--sizes", default="100,300,1000", help="training queries per domain (the learning curve)")
    p.add_argument("--held-out", type=int, default=350, help="held-out English queries per domain (evaluation "
                   "and sentinels; their other languages too)")
    p.add_argument("--docs", type=int, default=10000, help="corpus size: the domains' relevant documents, "
                   "then random distractors from other sections")
    p.add_argument("--model", default="multilingual-e5-small", help="bundled base or model directory")
    p.add_argument("--langs", default="en,de,fr,it", help="query languages evaluated (tuning is on en)")
    p.add_argument("--sentinel-n", type=int, default=200, help="queries per sentinel (domain x language)")
    p.add_argument("--tune-args", default="", help="extra `qswap tune run` options (quoted; default: the "
                   "default recipe)")
    p.add_argument("--concurrency", type=int, default=4, help="clients of the latency phase")
    p.add_argument("--latency-seconds", type=float, default=10.0, help="seconds per latency arm and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each latency arm (alternated)")
    p.add_argument("--seeds", type=int, default=200, help="simulated experiments per method and domain")
    p.add_argument("--min-decided", type=int, default=50, help="impressions at the first look (doubling after)")
    p.add_argument("--looks", type=int, default=16, help="looks (Bonferroni over them); the last is the budget")
    p.add_argument("--power", type=float, default=0.8, help="share of experiments that must decide")
    p.add_argument("--latency-only", action="store_true", help="only phase 5, on the index and the largest "
                   "size's domain encoders an earlier run left in --work (registered without sentinels); writes "
                   "bench/results/domains/latency/ unless --out says otherwise")
    p.add_argument("--work", type=Path, help="keep the corpus, index, encoders and server log here; a rerun on "
                   "the same folder reuses the index and the encoders whose inputs are unchanged")


def _quick(args: argparse.Namespace) -> None:
    args.sizes, args.held_out, args.docs, args.sentinel_n = "20", 30, 400, 30
    args.tune_args = args.tune_args or "--epoch-batches 3 --max-epochs 1"
    args.latency_seconds, args.rounds, args.seeds, args.looks = 1.0, 1, 20, 12


def run(args: argparse.Namespace) -> int:
    if args.quick:
        _quick(args)
    if args.latency_only:
        return _latency_only(args)
    out_dir = results_dir_for("domains", args.quick, args.out)
    w = ResultWriter("domains", out_dir)
    work = args.work or Path(tempfile.mkdtemp(prefix="qswap-domains-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = _run(args, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    heatmap(w.plot_path("matrix.png"), results)
    learning_curve_plot(w.plot_path("learning_curve.png"), results)
    w.write(results, markdown(results))
    print(f"results: {out_dir}")
    return 0


def _latency_only(args: argparse.Namespace) -> int:
    """Phase 5 alone (a quiet machine for the timings), on what ``--work`` holds from a full run."""
    from qswap.bench.fixtures import debian_dir
    if args.work is None or not (args.work / "index.built").is_file():
        raise InvalidInputError("--latency-only needs the --work folder of an earlier full run",
                                "run `qswap bench domains --work DIR` first")
    out_dir = args.out or results_dir_for("domains", args.quick, None) / "latency"
    w = ResultWriter("domains", out_dir)
    names = [x for x in args.domains.split(",") if x]
    main = max(int(x) for x in args.sizes.split(","))
    data = load_domains(args.beir or debian_dir(), names, ["en"], held_out=args.held_out, max_train=main,
                        docs=args.docs)
    missing = [d for d in names if not (args.work / "encoders" / f"{d}-{main}" / "report.json").is_file()]
    if missing:
        raise InvalidInputError(f"no tuned encoder for {', '.join(missing)} (size {main}) in {args.work}",
                                "run the full bench on this --work first, with the same --sizes")
    port = free_port()
    state = Path(tempfile.mkdtemp(prefix="qswap-domains-state-"))
    cmd = _cli("serve", "--model", args.model, "--index", str(args.work / "index"), "--read-only-index",
               "--state-dir", str(state), "--encoders-root", str(args.work / "encoders"), "--insecure",
               "--port", str(port), "--log-format", "text")
    try:
        with ServerProcess(cmd, port, ready_path="/readyz", log_path=state / "server.log") as srv:
            reg = _register(srv, {f"{d}-{main}": {} for d in names}, names, main)
            res = {"setup": {"domains": names, "size": main, "work": str(args.work), "guard": "no sentinels"},
                   "registration": reg, "latency": _latency(port, data, names, args)}
    finally:
        shutil.rmtree(state, ignore_errors=True)
    w.write(res, latency_markdown(res["latency"]))
    print(f"results: {out_dir}")
    return 0


class _Clock:
    """Wall seconds per phase (which part of the run dominates)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._t, 1)
        self._t = now


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "qswap.cli", *argv]


def _digest(path: Path) -> str:
    import hashlib
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        raise InvalidInputError(f"{what} failed: {(proc.stderr or '').strip()[-2000:]}", "see the message")


def _run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from qswap.bench.fixtures import debian_dir
    clock = _Clock()
    names = [x for x in args.domains.split(",") if x]
    if GENERAL in names or BASE in names:
        raise InvalidInputError(f"domain names {GENERAL!r} and {BASE!r} are reserved", "rename the section")
    sizes = sorted(int(x) for x in args.sizes.split(","))
    langs = [x for x in args.langs.split(",") if x]
    if langs[0] != "en":
        raise InvalidInputError("--langs must start with en (the training language)", "e.g. en,de,fr,it")
    beir = args.beir or debian_dir()
    data = load_domains(beir, names, langs, held_out=args.held_out, max_train=sizes[-1], docs=args.docs)
    corpus = write_corpus(data, work / "corpus.jsonl")
    clock.lap("data")
    idx = work / "index"
    built = work / "index.built"     # an index from an earlier run on this --work: the same corpus
    if not (built.is_file() and built.read_text() == _digest(corpus)):
        _check(subprocess.run(_cli("index", "build", str(corpus), "--out", str(idx), "--model", args.model,
                                   "--no-progress"), capture_output=True, text=True), "qswap index build")
        built.write_text(_digest(corpus))
    clock.lap("index build")
    enc_root = work / "encoders"
    tuned = _tune_all(args, data, corpus, idx, enc_root, work, sizes, langs)
    clock.lap("tuning")
    sent = _sentinels(args, data, work, langs)
    clock.lap("sentinels")
    port = free_port()
    cmd = _cli("serve", "--model", args.model, "--index", str(idx), "--read-only-index", "--state-dir",
               str(work / "state"), "--encoders-root", str(enc_root), "--sentinels", str(sent), "--insecure",
               "--port", str(port), "--log-format", "text")
    res: dict[str, Any] = {"setup": _setup(args, data, names, sizes, langs, beir)}
    with ServerProcess(cmd, port, ready_path="/readyz", log_path=work / "server.log") as srv:
        res["registration"] = _register(srv, tuned, names, sizes[-1])
        clock.lap("registration (guard)")
        ranks = _rankings(srv, data, names, sizes, langs)
        clock.lap("evaluation over HTTP")
        res["quality"] = _quality(data, ranks, names, sizes, langs)
        res["latency"] = _latency(port, data, names, args)
        clock.lap("latency")
    res["tuning"] = tuned
    res["power"] = _power(data, ranks, names, args)
    clock.lap("interleave vs A/B")
    res["phases_seconds"] = clock.seconds
    return res


def _setup(args: argparse.Namespace, data: DomainData, names: list[str], sizes: list[int], langs: list[str],
           beir: Path) -> dict[str, Any]:
    return {"beir": str(beir), "domains": names, "sizes": sizes, "langs": langs, "model": args.model,
            "documents": len(data.corpus), "distractors": data.distractors, "corpus_sections": data.sections,
            "held_out": {d.name: {lang: len(data.lang_queries(lang, d.held_out)) for lang in langs}
                         for d in data.domains},
            "training_pool": {d.name: len(d.pool) for d in data.domains},
            "tune_args": args.tune_args, "sentinel_n": args.sentinel_n}


# ----------------------------------------------------------------------------- tuning

def _tune_all(args: argparse.Namespace, data: DomainData, corpus: Path, idx: Path, enc_root: Path, work: Path,
              sizes: list[int], langs: list[str]) -> dict[str, Any]:
    """Every encoder: per size, one per domain and the general one (``qswap tune run`` each)."""
    out: dict[str, Any] = {}
    for n in sizes:
        jobs = [(f"{d.name}-{n}", d.train(n)) for d in data.domains]
        jobs.append((f"{GENERAL}-{n}", [q for d in data.domains for q in d.train(n)]))
        for name, qids in jobs:
            beir = write_subset(data, corpus, work / "train" / name, qids, ["en"])
            report = enc_root / name / "report.json"
            digest = _digest(beir / "queries-en.jsonl") + _digest(idx / "manifest.json") + args.tune_args
            done = work / "train" / name / "tuned"     # tuned by an earlier run on this --work, same inputs
            cmd = _cli("tune", "run", "--allow-identity", "--beir", str(beir), "--lang", "en", "--index", str(idx), "--mine", "index",
                       "--test-size", "0", "--base", args.model, "--out", str(enc_root / name), "--name", name,
                       "--quiet", *args.tune_args.split())
            t0 = time.perf_counter()
            reused = done.is_file() and done.read_text() == digest and report.is_file()
            if not reused:
                shutil.rmtree(enc_root / name, ignore_errors=True)
                _check(subprocess.run(cmd, capture_output=True, text=True), f"tune run {name}")
                done.write_text(digest)
            rep = json.loads(report.read_text())
            out[name] = {"queries": len(qids), "reused": reused,
                         "seconds": round(rep["wall_seconds_total"] if reused else time.perf_counter() - t0, 1),
                         "steps": rep["training"]["steps"], "best_epoch": rep["training"].get("best_epoch"),
                         "kind": rep["encoder"]["kind"], "splits": rep["data"]["splits"],
                         "phases": rep.get("phases"), "command": " ".join(cmd[3:])}
            print(f"  tuned {name}: {out[name]['seconds']} s, {out[name]['steps']} steps", file=sys.stderr)
    return out


def _sentinels(args: argparse.Namespace, data: DomainData, work: Path, langs: list[str]) -> Path:
    """One sentinel per domain and language, from the domain's held-out queries only (the
    library call ``qswap sentinels make`` runs; every judged document is in the index)."""
    from qswap.guard.sentinels import JudgedQueries, make_sentinel
    sent = work / "sentinels"
    for d in data.domains:
        for lang in langs:
            qids = data.lang_queries(lang, d.held_out)
            # Fewer than the server's --guard-min-queries (20) decide nothing and refuse every encoder.
            if len(qids) >= MIN_SENTINEL:
                sd = JudgedQueries({q: data.queries[lang][q] for q in qids}, {q: data.qrels[lang][q] for q in qids},
                                  f"bench domains: held-out {d.name} queries", lang)
                make_sentinel(sd, sent, f"{d.name}-{lang}", args.sentinel_n)
    return sent


# ----------------------------------------------------------------------------- server

def _call(srv: ServerProcess, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200, 201)) -> Any:
    status, out = http_json(method, srv.url(path), body, timeout=900)
    if status not in ok:
        raise InvalidInputError(f"{method} {path} answered {status}: {out}", "see the server log")
    return out


def _register(srv: ServerProcess, tuned: dict[str, Any], names: list[str], main_size: int) -> dict[str, Any]:
    """Each encoder through the guard (``wait``); a refusal is recorded, then forced in to be measured."""
    out: dict[str, Any] = {}
    for name in tuned:
        t0 = time.perf_counter()
        body = _call(srv, "POST", "/v1/encoders", {"path": name, "wait": True}, ok=(200, 201, 409))
        rec: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 1)}
        if (body or {}).get("error") == "guard_refused":
            guard = body.get("guard") or {}
            rec["verdict"] = "refused"
            rec["guard_verdict"] = guard.get("verdict")
            for what in ("regressed", "insufficient_evidence"):
                rec[what] = sorted({c["name"] for c in guard.get("checks", []) if c.get("verdict") == what})
            body = _call(srv, "POST", "/v1/encoders", {"path": name, "wait": True, "force": True})
        elif "encoder" not in (body or {}):
            raise InvalidInputError(f"registering {name} answered {body}", "see the server log")
        enc = body["encoder"]
        rec.setdefault("verdict", enc.get("guard_status"))
        rec["key"] = enc["key"]
        out[name] = rec
    for d in names:
        rec = out[f"{d}-{main_size}"]
        _call(srv, "PUT", f"/v1/aliases/{d}", {"encoder": rec["key"], "force": rec["verdict"] == "refused"})
    out["aliases"] = _call(srv, "GET", "/v1/aliases")["aliases"]
    return out


def _search(srv: ServerProcess, texts: list[str], route: dict[str, str]) -> list[list[str]]:
    out: list[list[str]] = []
    for i in range(0, len(texts), 32):
        res = _call(srv, "POST", "/v1/search", {"queries": texts[i:i + 32], "k": K, "with_text": False, **route})
        out += [[h["id"] for h in r["hits"]] for r in res["results"]]
    return out


def _routes(names: list[str], sizes: list[int]) -> dict[str, tuple[dict[str, str], list[str]]]:
    """Encoder label -> (how a request selects it, the domains it is evaluated on).

    The largest size: every encoder on every domain (the matrix), a domain's own one through
    its alias. Smaller sizes: a domain encoder on its domain, the general one on all."""
    main = sizes[-1]
    routes: dict[str, tuple[dict[str, str], list[str]]] = {BASE: ({"encoder": "base"}, names)}
    for n in sizes:
        routes[f"{GENERAL}-{n}"] = ({"encoder": f"{GENERAL}-{n}@1"}, names)
        for d in names:
            routes[f"{d}-{n}"] = ({"encoder": f"{d}-{n}@1"}, names if n == main else [d])
    for d in names:
        routes[f"alias:{d}"] = ({"domain": d}, [d])
    return routes


def _rankings(srv: ServerProcess, data: DomainData, names: list[str], sizes: list[int],
              langs: list[str]) -> dict[tuple[str, str, str], list[list[str]]]:
    """(encoder label, domain, language) -> served top-10 ids of the domain's held-out queries."""
    out = {}
    for label, (route, doms) in _routes(names, sizes).items():
        for d in data.domains:
            if d.name not in doms:
                continue
            for lang in langs:
                qids = data.lang_queries(lang, d.held_out)
                if qids:
                    out[(label, d.name, lang)] = _search(srv, [data.queries[lang][q] for q in qids], route)
        print(f"  evaluated {label}", file=sys.stderr)
    return out


# ----------------------------------------------------------------------------- quality

def _per_query(data: DomainData, ranks: dict, label: str, dom: str, lang: str) -> list[float]:
    d = next(x for x in data.domains if x.name == dom)
    qids = data.lang_queries(lang, d.held_out)
    rel = data.qrels[lang]
    return [ndcg_at_10([rel[q].get(i, 0) for i in r], list(rel[q].values()))
            for q, r in zip(qids, ranks[(label, dom, lang)])]


def _family(tests: list[tuple[tuple, list[float], list[float]]]) -> dict[tuple, dict[str, Any]]:
    """Paired Wilcoxon per test, Holm over the family; ``better``/``worse`` at p_holm < 0.05."""
    rows = {key: paired_compare(b, a).to_dict() for key, b, a in tests}
    for key, p in zip(rows, holm([r["p_value"] for r in rows.values()])):
        r = rows[key]
        r["p_holm"] = p
        r["better"] = bool(p < 0.05 and r["mean_after"] > r["mean_before"])
        r["worse"] = bool(p < 0.05 and r["mean_after"] < r["mean_before"])
    return rows


def _quality(data: DomainData, ranks: dict, names: list[str], sizes: list[int], langs: list[str]) -> dict[str, Any]:
    nd = {}
    for (label, dom, lang) in ranks:
        nd[(label, dom, lang)] = _per_query(data, ranks, label, dom, lang)
    mean = {"|".join(k): sum(v) / len(v) for k, v in nd.items() if v}
    main = sizes[-1]
    # The matrix per language: each encoder of the largest size against the base, Holm over the matrix.
    matrix = {}
    for lang in langs:
        tests = [((enc, dom), nd[(BASE, dom, lang)], nd[(enc, dom, lang)])
                 for enc in [f"{x}-{main}" for x in names] + [f"{GENERAL}-{main}"] for dom in names
                 if (enc, dom, lang) in nd]
        matrix[lang] = {f"{e}|{d}": r for (e, d), r in _family(tests).items()}
    # Per size: own-domain encoder vs base in every language (Holm over domain x language), general
    # vs base likewise, and own-domain vs general (Holm over domain x language).
    curve = {}
    for n in sizes:
        keys = [(dom, lang) for dom in names for lang in langs if (BASE, dom, lang) in nd]
        own = _family([((dom, lang), nd[(BASE, dom, lang)], nd[(f"{dom}-{n}", dom, lang)]) for dom, lang in keys])
        gen = _family([((dom, lang), nd[(BASE, dom, lang)], nd[(f"{GENERAL}-{n}", dom, lang)]) for dom, lang in keys])
        vs = _family([((dom, lang), nd[(f"{GENERAL}-{n}", dom, lang)], nd[(f"{dom}-{n}", dom, lang)])
                      for dom, lang in keys])
        curve[str(n)] = {f"{dom}|{lang}": {"own_vs_base": own[(dom, lang)], "general_vs_base": gen[(dom, lang)],
                                           "own_vs_general": vs[(dom, lang)]} for dom, lang in keys}
    # The alias serves exactly the encoder it points at (same rankings as naming the encoder).
    alias_same = {dom: ranks[(f"alias:{dom}", dom, "en")] == ranks[(f"{dom}-{main}", dom, "en")] for dom in names}
    return {"mean_ndcg": mean, "matrix": matrix, "curve": curve, "alias_serves_encoder": alias_same}


# ----------------------------------------------------------------------------- latency and power

def _latency(port: int, data: DomainData, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Mixed traffic (domains round-robin through their aliases) vs the base alone, same texts."""
    per = {d.name: [data.queries["en"][q] for q in d.held_out] for d in data.domains}
    m = min(len(v) for v in per.values())
    order = [(names[i % len(names)], per[names[i % len(names)]][(i // len(names)) % m]) for i in range(len(names) * m)]
    reqs = {"mixed": [Request.post_json("/v1/search", {"query": t, "k": K, "with_text": False, "domain": d})
                      for d, t in order],
            "base": [Request.post_json("/v1/search", {"query": t, "k": K, "with_text": False, "encoder": "base"})
                     for _, t in order]}
    lat: dict[str, list[float]] = {"base": [], "mixed": []}
    runs: dict[str, list[dict]] = {"base": [], "mixed": []}
    for r in range(args.rounds):
        for arm in (("base", "mixed") if r % 2 == 0 else ("mixed", "base")):
            res = run_load_sync("127.0.0.1", port, reqs[arm], concurrency=args.concurrency, max_requests=10 ** 6,
                                duration_s=args.latency_seconds)
            lat[arm] += res.latencies_ms()
            runs[arm].append(res.summary())
    s = {a: summarize(v) for a, v in lat.items()}
    return {"concurrency": args.concurrency, "runs": runs, "latency_ms": s,
            "p50_ratio": s["mixed"]["p50"] / s["base"]["p50"], "p99_ratio": s["mixed"]["p99"] / s["base"]["p99"],
            "target_p50_ratio": 1.1}


def _power(data: DomainData, ranks: dict, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for d in data.domains:
        qids = data.lang_queries("en", d.held_out)
        out[d.name] = fixed_power(ranks[(BASE, d.name, "en")], ranks[(f"alias:{d.name}", d.name, "en")],
                                  [data.qrels["en"][q] for q in qids], seeds=args.seeds,
                                  min_decided=args.min_decided, n_looks=args.looks, power=args.power)
    return {"power": args.power, "min_decided": args.min_decided, "looks": args.looks, "domains": out}

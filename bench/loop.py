"""``qswap bench loop``: learning from live traffic, end to end, with a simulated user.

A real ``qswap serve --feedback-dir --sentinels`` (child process) serves a domain alias over an
index; a simulated user draws queries from the domain's query set and clicks by a seeded
**cascade click model** (examines the list top down, clicks a document with a probability set
by its qrels relevance, stops after a satisfying click, abandons with a position bias). One
command runs every phase:

1. ``--sessions`` searches on the base encoder with capture on, each followed by its clicks (the
   application's protocol: it searches with the search token, names each simulated user's
   session, and reports the clicks with the ``impression`` id the search answered with);
2. ``qswap tune run --feedback`` on the captured feedback only (no qrels), then registration
   with the server's guard (``wait``: the verdict);
3. an interleaving experiment base vs candidate over HTTP until the sign test decides (tested
   at doubling looks, Bonferroni); the same decision rule replayed offline on the two encoders'
   served rankings for ``--seeds`` simulated users gives the median impressions needed, against
   an A/B test of click-through rate (two-proportion test at the same looks) on the same users;
4. promotion (the atomic alias switch), then nDCG@10 from the qrels on held-out queries in
   every language: the candidate against the base with the guard's own test (Wilcoxon signed
   rank, Holm over the languages);
5. false alarms: base against itself, interleaved, over the seeds;
6. live traffic while a shadow experiment runs against no experiment at the same closed-loop
   load (arms alternated): p50 / p99.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from qswap.beir import load_beir, resolve_language
from qswap.bench.loadgen import Request, run_load_sync
from qswap.bench.processes import ServerProcess, free_port, http_json
from qswap.bench.results import ResultWriter, md_table, results_dir_for
from qswap.bench.stats import summarize
from qswap.errors import InvalidInputError
from qswap.feedback.interleave import credit, decided, looks, team_draft
from qswap.guard.evaluation import ndcg_at_10
from qswap.plotting import pyplot, save_figure

DOMAIN = "deb"
K = 10
TOKEN = "loop-search-token"                  # the simulated application's search token
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--index", type=Path, help="the served index (e.g. 10,000 Debian documents)")
    p.add_argument("--beir", type=Path, help="its BEIR set: queries per language and qrels (e.g. deb10k)")
    p.add_argument("--model", default="multilingual-e5-small", help="bundled base or model directory")
    p.add_argument("--lang", default="en", help="the domain's traffic language (the one tuned)")
    p.add_argument("--langs", default="en,de,fr,it", help="languages evaluated after promotion")
    p.add_argument("--sessions", type=int, default=2000, help="captured sessions on the base (phase 1)")
    p.add_argument("--held-out", type=float, default=0.3, help="share of the domain's queries never used "
                   "as traffic (sentinels and the final nDCG)")
    p.add_argument("--sentinel-n", type=int, default=300, help="queries per sentinel (one per language)")
    p.add_argument("--sentinel-langs", help="languages with a sentinel (default: --langs)")
    p.add_argument("--seeds", type=int, default=100, help="simulated users replayed offline (phases 3, 5)")
    p.add_argument("--replay-queries", type=int, default=2000, help="traffic queries whose rankings the "
                   "offline replays draw from")
    p.add_argument("--eval-n", type=int, default=1000, help="held-out queries per language for nDCG@10")
    p.add_argument("--min-decided", type=int, default=50, help="decided impressions at the first look (ten "
                   "looks: x1, 2, 4 ... 512)")
    p.add_argument("--live-impressions", type=int, default=2000, help="interleaved sessions over HTTP at most "
                   "(phase 3; the replays measure impressions to decide)")
    p.add_argument("--tune-args", default="", help="extra `qswap tune run` options (quoted)")
    p.add_argument("--concurrency", type=int, default=4, help="clients of the shadow latency phase")
    p.add_argument("--shadow-seconds", type=float, default=10.0, help="seconds per arm and round (phase 6)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each latency arm (alternated)")


# ----------------------------------------------------------------------------- the simulated user

@dataclass(frozen=True)
class CascadeUser:
    """A cascade click model with position bias (a simplified dynamic Bayesian network model).

    From the top: the user examines a result, clicks it with ``click[grade]``; a click on a
    relevant result satisfies with ``satisfy`` (the session ends); otherwise the user goes on
    to the next result with ``persist`` (so lower ranks are examined less often).
    """

    click_relevant: float = 0.9
    click_other: float = 0.05
    satisfy: float = 0.9
    persist: float = 0.8

    def clicks(self, ids: Sequence[str], grades: dict[str, int], rng: random.Random) -> list[str]:
        out = []
        for d in ids:
            rel = grades.get(d, 0) > 0
            if rng.random() < (self.click_relevant if rel else self.click_other):
                out.append(d)
                if rel and rng.random() < self.satisfy:
                    break
            if rng.random() >= self.persist:
                break
        return out


def impressions_to_decide(outcomes: Callable[[int], int], alpha: float, min_decided: int, max_n: int) -> int | None:
    """Impressions until the sign test decides at a look (None: undecided within ``max_n``)."""
    wins = losses = 0
    for n in range(1, max_n + 1):
        o = outcomes(n)
        wins += o > 0
        losses += o < 0
        if decided(wins, losses, alpha, min_decided):
            return n
    return None


def ab_impressions_to_decide(ctr_of: Callable[[int, str], bool], rng: random.Random, alpha: float,
                             min_decided: int, max_n: int) -> int | None:
    """An A/B test of click-through rate: users split at random, a two-proportion test on the
    share of impressions with a click, at the same looks (total impressions) and correction."""
    from scipy.stats import fisher_exact
    checks = set(looks(min_decided))
    n_looks = len(checks)
    counts = {"A": [0, 0], "B": [0, 0]}   # [impressions, with a click]
    for n in range(1, max_n + 1):
        arm = "A" if rng.random() < 0.5 else "B"
        counts[arm][0] += 1
        counts[arm][1] += ctr_of(n, arm)
        if n in checks:
            (na, ca), (nb, cb) = counts["A"], counts["B"]
            if na and nb and fisher_exact([[ca, na - ca], [cb, nb - cb]])[1] < alpha / n_looks:
                return n
    return None


def served_ndcg(ranked: Sequence[str], grades: dict[str, int]) -> float:
    """nDCG@10 of a served ranking of ids (:func:`qswap.guard.evaluation.ndcg_at_10`)."""
    return ndcg_at_10([grades.get(d, 0) for d in ranked], list(grades.values()))


# ----------------------------------------------------------------------------- HTTP helpers

class _Api:
    def __init__(self, srv: ServerProcess) -> None:
        self.srv = srv

    def call(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200, 201)) -> Any:
        status, out = http_json(method, self.srv.url(path), body, timeout=600, headers=AUTH)
        if status not in ok:
            raise InvalidInputError(f"{method} {path} answered {status}: {out}", "see the server log")
        return out

    def search(self, query: str, **kw: Any) -> tuple[str, list[str]]:
        """One search; returns its impression id (to send the clicks with) and the ids shown."""
        body = self.call("POST", "/v1/search", {"query": query, "k": K, "with_text": False, **kw})
        return body["impression"], [h["id"] for h in body["results"][0]["hits"]]

    def rankings(self, queries: list[str], encoder: str) -> list[list[str]]:
        out: list[list[str]] = []
        for i in range(0, len(queries), 32):
            res = self.call("POST", "/v1/search", {"queries": queries[i:i + 32], "k": K, "with_text": False,
                                                   "encoder": encoder})
            out += [[h["id"] for h in r["hits"]] for r in res["results"]]
        return out


def _sessions(api: _Api, qids: list[str], queries: dict[str, str], qrels: dict[str, dict[str, int]], n: int,
              user: CascadeUser, seed: int, workers: int = 4,
              until: Callable[[list[int]], bool] | None = None) -> dict[str, Any]:
    """``n`` search + feedback sessions (or until ``until(outcomes)``); returns counts and outcomes."""
    rng = random.Random(seed)
    plan = [(rng.choice(qids), rng.random(), f"user-{seed}-{i}") for i in range(n)]
    outcomes: list[int] = []
    clicked = 0
    stop = False

    def one(item: tuple[str, float, str]) -> tuple[int, int | None]:
        qid, s, session = item   # every session a simulated user of its own
        impression, ids = api.search(queries[qid], domain=DOMAIN, session=session)
        c = user.clicks(ids, qrels[qid], random.Random(s))
        out = api.call("POST", "/v1/feedback", {"impression": impression, "clicks": c})
        return len(c), out.get("outcome")

    done = 0
    with ThreadPoolExecutor(workers) as pool:
        for start in range(0, n, workers * 8):
            for nc, o in pool.map(one, plan[start:start + workers * 8]):
                done += 1
                clicked += nc > 0
                if o is not None:
                    outcomes.append(o)
                    if until is not None and until(outcomes):
                        stop = True
            if stop:
                break
            print(f"  sessions {done}/{n}", file=sys.stderr, flush=True)
    return {"sessions": done, "with_click": clicked, "outcomes": outcomes}


# ----------------------------------------------------------------------------- the run

def run(args: argparse.Namespace) -> int:
    if args.quick:
        raise InvalidInputError("bench loop has no --quick: it needs an index and its BEIR set",
                                "run it on a small set instead (tests do: tests/bench/test_loop.py)")
    if args.index is None or args.beir is None:
        raise InvalidInputError("bench loop needs --index and --beir", "e.g. --index idx10k --beir deb10k")
    out_dir = results_dir_for("loop", False, args.out)
    w = ResultWriter("loop", out_dir)
    work = Path(tempfile.mkdtemp(prefix="qswap-loop-"))
    try:
        results = _run(args, work, w)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    plot(w.plot_path("decide.png"), results)
    w.write(results, _markdown(results))
    print(f"results: {out_dir}")
    return 0


def _split(args: argparse.Namespace, index_ids: set[str]) -> tuple[dict, dict, list[str], list[str]]:
    lang = resolve_language(args.beir, args.lang)
    _, queries, qrels = load_beir(args.beir, lang, strict=False)
    judged = sorted(q for q in queries if any(g > 0 and d in index_ids for d, g in qrels.get(q, {}).items()))
    random.Random(0).shuffle(judged)
    n_held = max(1, int(len(judged) * args.held_out))
    return queries, qrels, judged[n_held:], judged[:n_held]


def _run(args: argparse.Namespace, work: Path, w: ResultWriter) -> dict[str, Any]:
    py = [sys.executable, "-m", "qswap.cli"]
    from qswap.index import open_index
    idx = open_index(args.index, read_only=True)
    index_ids = set(idx.export_embeddings()[0])
    idx.close()
    queries, qrels, pool_q, held_q = _split(args, index_ids)
    langs = [x for x in args.langs.split(",") if x]
    pool_file = work / "traffic-qids.txt"
    pool_file.write_text("\n".join(pool_q) + "\n")
    # Sentinels from held-out queries only (never traffic, so never trained on).
    sent = work / "sentinels"
    for lang in (args.sentinel_langs.split(",") if args.sentinel_langs else langs):
        subprocess.run([*py, "sentinels", "make", "--beir", str(args.beir), "--lang", lang, "--index",
                        str(args.index), "--out", str(sent), "--n", str(args.sentinel_n), "--name", lang,
                        "--exclude-qids", str(pool_file)], check=True, stdout=subprocess.DEVNULL)
    port = free_port()
    enc_root = work / "encoders"
    enc_root.mkdir()
    cmd = [*py, "serve", "--model", args.model, "--index", str(args.index), "--read-only-index",
           "--state-dir", str(work / "state"), "--encoders-root", str(enc_root), "--sentinels", str(sent),
           "--feedback-dir", str(work / "feedback"), "--insecure", "--search-token", TOKEN, "--port", str(port),
           "--log-format", "text"]
    user = CascadeUser()
    res: dict[str, Any] = {"setup": {"traffic_queries": len(pool_q), "held_out_queries": len(held_q),
                                     "lang": args.lang, "langs": langs, "click_model": user.__dict__,
                                     "sessions": args.sessions, "seeds": args.seeds,
                                     "looks": looks(args.min_decided), "alpha": 0.05}}
    with ServerProcess(cmd, port, ready_path="/readyz", log_path=work / "server.log") as srv:
        api = _Api(srv)
        api.call("PUT", f"/v1/aliases/{DOMAIN}", {"encoder": "base"})
        # 1. traffic on the base, captured
        t0 = time.perf_counter()
        res["capture"] = _sessions(api, pool_q, queries, qrels, args.sessions, user, seed=1)
        res["capture"].pop("outcomes")
        res["capture"]["seconds"] = time.perf_counter() - t0
        # 2. tune from the feedback only, register with the guard
        t0 = time.perf_counter()
        tune = [*py, "tune", "run", "--allow-identity", "--base", args.model, "--feedback", str(work / "feedback"), "--domain", DOMAIN,
                "--index", str(args.index), "--out", str(enc_root / "cand"), "--name", "cand", "--quiet",
                *args.tune_args.split()]
        proc = subprocess.run(tune, capture_output=True, text=True)
        if proc.returncode != 0:
            raise InvalidInputError(f"tune run failed: {proc.stderr.strip()[-2000:]}", "see the message")
        report = json.loads((enc_root / "cand" / "report.json").read_text())
        reg = api.call("POST", "/v1/encoders", {"path": "cand", "wait": True}, ok=(200, 201, 409))
        res["tuning"] = {"seconds": time.perf_counter() - t0, "command": " ".join(tune[2:]),
                         "steps": report["training"]["steps"], "phases": report.get("phases"),
                         "mining": (report.get("data") or {}).get("mining") is not None,
                         "registration": (reg.get("encoder") or {}).get("guard_status") or reg.get("error")}
        cand = "cand@1"
        # 3. interleaving over HTTP until decided (one user), then offline replays for the seeds
        api.call("POST", "/v1/experiments", {"domain": DOMAIN, "candidate": cand, "mode": "interleave",
                                             "fraction": 1.0})
        live = _sessions(api, pool_q, queries, qrels, args.live_impressions, user, seed=2,
                         until=lambda o: decided(sum(x > 0 for x in o), sum(x < 0 for x in o), 0.05,
                                                 args.min_decided))
        view = api.call("GET", f"/v1/experiments/{DOMAIN}")
        res["interleave_live"] = {"impressions": view["impressions"], "wins": view["wins"], "losses": view["losses"],
                                  "ties": view["ties"], "p_value": view["p_value"], "clients": view["clients"],
                                  "counted_wins": view["counted_wins"], "counted_losses": view["counted_losses"],
                                  "decided": live["sessions"] < args.live_impressions}
        replay_q = pool_q[:args.replay_queries]
        texts = [queries[q] for q in replay_q]
        ranks = {"base": api.rankings(texts, "base"), "cand": api.rankings(texts, cand)}
        res["replay"] = _replay(replay_q, qrels, ranks, user, args)
        # 4. promote, then held-out nDCG@10 per language with the guard's test
        promo = api.call("POST", f"/v1/experiments/{DOMAIN}/promote", ok=(200, 409))
        res["promotion"] = {"status": promo.get("status") or promo.get("error"),
                            "alias": api.call("GET", "/v1/aliases")["aliases"][DOMAIN]}
        res["ndcg"] = _held_out_ndcg(api, args, held_q, langs, cand)
        # 6. live latency with a shadow experiment vs none (the promoted encoder serves the domain)
        res["shadow"] = _shadow_latency(api, srv, port, texts, args)
    return res


def _replay(pool_q: list[str], qrels: dict, ranks: dict[str, list[list[str]]], user: CascadeUser,
            args: argparse.Namespace) -> dict[str, Any]:
    """Phases 3 and 5 offline: the server's own interleaving and decision code on its rankings,
    for up to the last look's number of impressions."""
    n_q = len(pool_q)
    # Looks count decided impressions (ties left out): twice the last look leaves room for ties.
    budget = 2 * looks(args.min_decided)[-1]

    def interleaved(a: str, b: str, seed: int) -> int | None:
        rng = random.Random(seed)

        def outcome(_: int) -> int:
            i = rng.randrange(n_q)
            shown = team_draft(ranks[a][i], ranks[b][i], K, rng)
            return credit(shown, user.clicks(shown.ids, qrels[pool_q[i]], rng))
        return impressions_to_decide(outcome, 0.05, args.min_decided, budget)

    def ab(seed: int) -> int | None:
        rng = random.Random(seed)

        def ctr(_: int, arm: str) -> bool:
            i = rng.randrange(n_q)
            ids = ranks["base" if arm == "A" else "cand"][i]
            return bool(user.clicks(ids, qrels[pool_q[i]], rng))
        return ab_impressions_to_decide(ctr, random.Random(seed + 10 ** 6), 0.05, args.min_decided, budget)

    seeds = range(100, 100 + args.seeds)
    inter = [interleaved("base", "cand", s) for s in seeds]
    abn = [ab(s) for s in seeds]
    nulls = [interleaved("base", "base", s) for s in seeds]

    def med(xs: list[int | None]) -> float | None:
        # Undecided runs count as the budget (a lower bound on what they would need).
        vals = [x if x is not None else budget for x in xs]
        return float(np.median(vals)) if vals else None
    mi, ma = med(inter), med(abn)
    return {"interleave": {"impressions": inter, "median": mi, "undecided": sum(x is None for x in inter)},
            "ab_ctr": {"impressions": abn, "median": ma, "undecided": sum(x is None for x in abn)},
            "ab_over_interleave": (ma / mi) if mi and ma else None,
            "false_alarms": {"decided": sum(x is not None for x in nulls), "runs": len(nulls),
                             "rate": sum(x is not None for x in nulls) / len(nulls)}}


def _held_out_ndcg(api: _Api, args: argparse.Namespace, held_q: list[str], langs: list[str],
                   cand: str) -> dict[str, Any]:
    from qswap.guard.stats import holm, paired_compare
    rows = {}
    for lang in langs:
        _, q, rel = load_beir(args.beir, resolve_language(args.beir, lang), strict=False)
        qs = [x for x in held_q if x in q and x in rel][:args.eval_n]
        texts = [q[x] for x in qs]
        before = [served_ndcg(r, rel[x]) for r, x in zip(api.rankings(texts, "base"), qs)]
        after = [served_ndcg(r, rel[x]) for r, x in zip(api.rankings(texts, cand), qs)]
        rows[lang] = paired_compare(before, after).to_dict()
    adj = holm([r["p_value"] for r in rows.values()])
    for (lang, r), p in zip(rows.items(), adj):
        r["p_holm"] = p
        r["significant"] = bool(p < 0.05)
        r["better"] = bool(r["significant"] and r["mean_after"] > r["mean_before"])
        r["worse"] = bool(r["significant"] and r["mean_after"] < r["mean_before"])
    return rows


def _shadow_latency(api: _Api, srv: ServerProcess, port: int, texts: list[str],
                    args: argparse.Namespace) -> dict[str, Any]:
    head = (("Content-Type", "application/json"), *AUTH.items())
    reqs = [Request("POST", "/v1/search", json.dumps({"query": t, "k": K, "with_text": False, "domain": DOMAIN}).encode(),
                    head) for t in texts[:500]]
    arms: dict[str, list[float]] = {"none": [], "shadow": []}
    runs: dict[str, list[dict]] = {"none": [], "shadow": []}
    for r in range(args.rounds):
        for arm in (("none", "shadow") if r % 2 == 0 else ("shadow", "none")):
            if arm == "shadow":
                api.call("POST", "/v1/experiments", {"domain": DOMAIN, "candidate": "base", "mode": "shadow",
                                                     "fraction": 1.0})
            res = run_load_sync("127.0.0.1", port, reqs, concurrency=args.concurrency, max_requests=10 ** 6,
                                duration_s=args.shadow_seconds)
            if arm == "shadow":
                view = api.call("POST", f"/v1/experiments/{DOMAIN}/stop")
                res_extra = {"shadow_runs": view["shadow_runs"], "shadow_skipped": view["shadow_skipped"],
                             "overlap": view["overlap"]}
            else:
                res_extra = {}
            arms[arm] += res.latencies_ms()
            runs[arm].append({**res.summary(), **res_extra})
    s = {a: summarize(v) for a, v in arms.items()}
    return {"concurrency": args.concurrency, "runs": runs, "latency_ms": s,
            "p50_ratio": s["shadow"]["p50"] / s["none"]["p50"], "p99_ratio": s["shadow"]["p99"] / s["none"]["p99"]}


# ----------------------------------------------------------------------------- report

def _markdown(r: dict[str, Any]) -> str:
    rep, nd, sh = r["replay"], r["ndcg"], r["shadow"]
    lines = ["## Loop", "",
             md_table(["phase", "result"], [
                 ["1. capture", f"{r['capture']['sessions']} sessions, {r['capture']['with_click']} with a click "
                                f"({r['capture']['seconds']:.0f} s)"],
                 ["2. tune + register", f"{r['tuning']['steps']} steps, {r['tuning']['seconds']:.0f} s; "
                                        f"guard: {r['tuning']['registration']}"],
                 ["3. interleave (live)", f"{r['interleave_live']['impressions']} impressions, "
                                          f"{r['interleave_live']['wins']} wins / {r['interleave_live']['losses']} "
                                          f"losses from {r['interleave_live']['clients']} clients (sessions), "
                                          f"p {r['interleave_live']['p_value']:.2g}"],
                 ["3. median impressions to decide", f"interleave {rep['interleave']['median']}, A/B CTR "
                                                     f"{rep['ab_ctr']['median']} (x{rep['ab_over_interleave'] or 0:.1f})"],
                 ["4. promotion", f"{r['promotion']['status']} -> alias {r['promotion']['alias']}"],
                 ["5. false alarms (base vs base)", f"{rep['false_alarms']['decided']} of {rep['false_alarms']['runs']} "
                                                    f"({100 * rep['false_alarms']['rate']:.1f} %)"],
                 ["6. shadow latency", f"p50 x{sh['p50_ratio']:.3f}, p99 x{sh['p99_ratio']:.3f} at concurrency "
                                       f"{sh['concurrency']}"]]), "",
             "## Held-out nDCG@10 after promotion (Wilcoxon signed-rank, Holm over languages)", "",
             md_table(["language", "queries", "base", "promoted", "p (Holm)", "verdict"],
                      [[lang, x["n"], f"{x['mean_before']:.4f}", f"{x['mean_after']:.4f}", f"{x['p_holm']:.2g}",
                        "better" if x["better"] else "worse" if x["worse"] else "n.s."] for lang, x in nd.items()])]
    return "\n".join(lines) + "\n"


def plot(path: Path, r: dict[str, Any]) -> Path:
    """Impressions needed to decide: interleaving vs A/B on CTR, over the seeded users."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    rep = r["replay"]
    cap = r["setup"]["looks"][-1]
    data = [[x if x is not None else cap for x in rep[k]["impressions"]] for k in ("interleave", "ab_ctr")]
    ax.boxplot(data, tick_labels=["team-draft interleaving", "A/B on click-through"])
    ax.set_yscale("log")
    ax.set_ylabel("impressions until p < 0.05 (undecided = budget)")
    ax.set_title("base vs tuned-from-feedback encoder")
    return save_figure(fig, path)

"""`qswap bench domains` on a tiny set: a real index, real tuning runs, one real server, every phase."""

from __future__ import annotations

import json
import random

import numpy as np

from qswap.bench.domains_data import load_domains
from qswap.bench.domains_power import ab_to_decide, click_probability, interleave_to_decide
from qswap.bench.loop import CascadeUser
from qswap.cli import main

from ..tuning.conftest import write_beir

SECTIONS = ("alpha", "beta")


def _sectioned_beir(folder, n):
    """The tuning tests' BEIR set, each query and document given a section (alternating)."""
    beir = write_beir(folder, n, langs=("en", "de"))
    for name in ["corpus.jsonl", "queries-en.jsonl", "queries-de.jsonl"]:
        rows = [json.loads(x) for x in (beir / name).read_text().splitlines()]
        for r in rows:
            r["metadata"] = {"section": SECTIONS[int(r["_id"][1:]) % 2]}
        (beir / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return beir


def test_click_probability_is_the_cascade_users():
    user = CascadeUser()
    ids, grades = ["a", "b", "c", "d"], {"c": 1}
    rng = random.Random(0)
    mc = sum(bool(user.clicks(ids, grades, rng)) for _ in range(40000)) / 40000
    assert abs(click_probability(user, ids, grades) - mc) < 0.01
    assert click_probability(CascadeUser(click_other=0.0), ["a"], {}) == 0.0


def test_decision_rules_decide_a_clear_difference_and_not_a_null():
    rng = np.random.default_rng(0)
    assert interleave_to_decide(np.array([0.3, 0.1, 0.6]), rng, 20, 8) is not None
    assert ab_to_decide(0.5, 0.7, rng, 20, 8) is not None
    nulls = [interleave_to_decide(np.array([0.2, 0.2, 0.6]), rng, 20, 8) for _ in range(50)]
    assert sum(x is not None for x in nulls) <= 5
    assert ab_to_decide(0.5, 0.5, np.random.default_rng(1), 20, 4) is None


def test_splits_are_disjoint_and_nested(tmp_path):
    beir = _sectioned_beir(tmp_path / "beir", 200)
    data = load_domains(beir, list(SECTIONS), ["en", "de"], held_out=30, max_train=40, docs=150)
    for d in data.domains:
        assert len(d.held_out) == 30 and len(d.pool) == 40 and not set(d.held_out) & set(d.pool)
        assert d.train(20) == d.pool[:20]
    used_docs = {doc for d in data.domains for q in d.held_out + d.pool for doc in data.qrels["en"][q]}
    assert used_docs <= set(data.corpus) and len(data.corpus) == 150


def test_bench_domains_runs_every_phase(tiny_model_dir, tmp_path):
    beir = _sectioned_beir(tmp_path / "beir", 240)
    out = tmp_path / "out"
    rc = main(["bench", "domains", "--beir", str(beir), "--model", str(tiny_model_dir), "--domains", "alpha,beta",
               "--sizes", "20", "--held-out", "40", "--docs", "200", "--langs", "en,de", "--sentinel-n", "20",
               "--tune-args", "--lr 3e-3 --batch-size 4 --epoch-batches 3 --max-epochs 1 --loss infonce",
               "--latency-seconds", "0.5", "--rounds", "2", "--concurrency", "2", "--seeds", "10",
               "--min-decided", "5", "--looks", "8", "--work", str(tmp_path / "work"), "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "results.json").read_text())["results"]
    # one training size (each size is three `qswap tune run` processes; the curve's sizes are
    # nested splits, tested above)
    assert set(r["tuning"]) == {"alpha-20", "beta-20", "general-20"}
    assert r["tuning"]["general-20"]["queries"] == 40
    reg = r["registration"]
    assert reg["aliases"] == {"alpha": reg["alpha-20"]["key"], "beta": reg["beta-20"]["key"]}
    assert all(v["verdict"] in ("passed", "refused") for k, v in reg.items() if k != "aliases")
    q = r["quality"]
    assert set(q["matrix"]) == {"en", "de"} and len(q["matrix"]["en"]) == 6    # (2 domain + general) x 2 domains
    assert all(q["alias_serves_encoder"].values())
    assert set(q["curve"]) == {"20"} and "alpha|de" in q["curve"]["20"]
    assert all(0.0 <= v <= 1.0 for v in q["mean_ndcg"].values())
    assert r["latency"]["runs"]["mixed"][0]["ok"] > 0 and r["latency"]["latency_ms"]["base"]["p50"] > 0
    assert set(r["power"]["domains"]) == {"alpha", "beta"}
    assert len(r["power"]["domains"]["alpha"]["ab_ctr"]["impressions"]) == 10
    assert {"index build", "tuning", "evaluation over HTTP"} <= set(r["phases_seconds"])
    assert (out / "matrix.png").is_file() and (out / "learning_curve.png").is_file()
    assert "Encoder x domain" in (out / "README.md").read_text()
    # Phase 5 alone on what the run left in --work (no tuning again: the encoders are reused).
    lat = tmp_path / "lat"
    rc = main(["bench", "domains", "--latency-only", "--beir", str(beir), "--model", str(tiny_model_dir),
               "--domains", "alpha,beta", "--sizes", "20", "--held-out", "40", "--docs", "200",
               "--latency-seconds", "0.5", "--rounds", "2", "--concurrency", "2", "--work", str(tmp_path / "work"),
               "--out", str(lat)])
    assert rc == 0
    r2 = json.loads((lat / "results.json").read_text())["results"]
    assert set(r2["registration"]["aliases"]) == {"alpha", "beta"}
    assert r2["latency"]["runs"]["mixed"][0]["ok"] > 0 and "Mixed traffic" in (lat / "README.md").read_text()


def test_latency_only_needs_a_full_run_first(tmp_path, capsys):
    assert main(["bench", "domains", "--latency-only", "--work", str(tmp_path)]) == 2
    assert "earlier full run" in capsys.readouterr().err


def test_interleave_odds_are_the_servers_team_draft_and_the_cascade_user():
    from qswap.bench.domains_power import interleave_outcomes
    from qswap.feedback.interleave import credit, team_draft
    user = CascadeUser()
    a, b = ["d1", "d2", "d3", "d4"], ["d3", "d1", "d5", "d2"]
    g = {"d3": 1}
    exact = interleave_outcomes([a], [b], [g], user, k=4)
    rng, n = random.Random(0), 40000
    outs = [credit(s, user.clicks(s.ids, g, rng)) for s in (team_draft(a, b, 4, rng) for _ in range(n))]
    assert abs(exact[0] - outs.count(1) / n) < 0.01 and abs(exact[1] - outs.count(-1) / n) < 0.01
    same = interleave_outcomes([a], [a], [g], user, k=4)
    assert abs(same[0] - same[1]) < 1e-12                    # identical rankings: no preference at all

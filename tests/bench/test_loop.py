"""`qswap bench loop` end to end on a tiny set: a real server, the simulated user, every phase."""

from __future__ import annotations

import json
import random

from qswap.beir import read_corpus
from qswap.bench.loop import CascadeUser, ab_impressions_to_decide, impressions_to_decide, served_ndcg
from qswap.cli import main
from qswap.index import Document, create_index

from ..tuning.conftest import write_beir


def test_cascade_user_examines_top_down():
    user = CascadeUser(click_relevant=1.0, click_other=0.0, satisfy=1.0, persist=1.0)
    assert user.clicks(["a", "b", "c"], {"b": 1, "c": 1}, random.Random(0)) == ["b"]   # satisfied at b
    never = CascadeUser(persist=0.0, click_other=0.0, click_relevant=1.0)
    assert never.clicks(["a", "b"], {"b": 1}, random.Random(0)) == []    # abandoned after the first result


def test_decision_rules():
    assert impressions_to_decide(lambda n: 1, 0.05, 10, 1000) == 10          # 10 straight wins, first look
    assert impressions_to_decide(lambda n: 0, 0.05, 10, 1000) is None        # ties only
    rng = random.Random(0)
    assert ab_impressions_to_decide(lambda n, arm: arm == "B", rng, 0.05, 10, 1000) is not None
    assert served_ndcg(["x", "a"], {"a": 1}) == 1 / __import__("math").log2(3)
    assert served_ndcg(["a"], {"a": 1}) == 1.0


def test_bench_loop_runs_every_phase(tiny_model_dir, tiny_base, tmp_path):
    beir = write_beir(tmp_path / "beir", 120)
    corpus = read_corpus(beir)
    ids = list(corpus)
    create_index(tmp_path / "idx", [Document(i, corpus[i].text) for i in ids],
                 tiny_base.encode_documents([corpus[i].text for i in ids]), tiny_base.space).close()
    out = tmp_path / "out"
    rc = main(["bench", "loop", "--index", str(tmp_path / "idx"), "--beir", str(beir), "--model", str(tiny_model_dir),
               "--langs", "en,de", "--sentinel-langs", "en", "--sessions", "100", "--seeds", "10",
               "--sentinel-n", "20", "--min-decided", "5", "--live-impressions", "80",
               "--tune-args", "--lr 3e-3 --batch-size 8 --epoch-batches 3 --max-epochs 2 --fn-cutoff 1.0 --force",
               "--shadow-seconds", "1", "--rounds", "2", "--concurrency", "2", "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "results.json").read_text())["results"]
    assert r["capture"]["sessions"] == 100 and r["capture"]["with_click"] > 0
    assert r["tuning"]["mining"] is False or r["tuning"]["mining"] is True
    live = r["interleave_live"]
    assert live["impressions"] > 0 and live["clients"] > 1     # every simulated session a client
    rep = r["replay"]
    assert len(rep["interleave"]["impressions"]) == 10 and len(rep["ab_ctr"]["impressions"]) == 10
    assert 0 <= rep["false_alarms"]["rate"] <= 0.3
    assert set(r["ndcg"]) == {"en", "de"} and all(x["n"] > 0 for x in r["ndcg"].values())
    assert r["shadow"]["runs"]["shadow"][0]["ok"] > 0 and r["shadow"]["latency_ms"]["none"]["p50"] > 0
    assert (out / "decide.png").is_file() and (out / "README.md").is_file()

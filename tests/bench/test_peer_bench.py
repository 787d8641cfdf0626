"""``qswap bench peer`` end to end on a tiny model: qswap's arms, the files, and Infinity when installed."""

from __future__ import annotations

import json
import math

import pytest

from qswap.bench import peer
from qswap.bench.infinity_peer import models_that_fit, usable_python, venv_dir
from qswap.cli import main as qswap_main

pytestmark = pytest.mark.slow


def _quick(tiny_model_dir, out, *extra):
    return qswap_main(["bench", "peer", "--quick", "--model", str(tiny_model_dir), "--out", str(out),
                       "--seconds", "0.5", "--requests", "20", *extra])


def _points(res, scenario):
    return res["scenarios"][scenario]["levels"]


def test_qswap_arms_run_and_infinity_is_skipped_with_a_reason(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QSWAP_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "peer"
    # A venv that cannot be made: the benchmark says why in one line and measures qswap alone. The
    # hot-off arm rides along (one run of the bench, not two: its servers' start dominates), with
    # two hot slots so that the two domains of `many` both run hot.
    assert _quick(tiny_model_dir, out, "--infinity-venv", str(tmp_path / "a-file" / "venv"), "--hot-off-arm",
                  "--hot-encoders", "2") == 0
    err = capsys.readouterr().err
    assert "qswap bench peer: Infinity skipped: cannot create" in err and "Traceback" not in err
    doc = json.loads((out / "results.json").read_text())
    res, meta = doc["results"], doc["meta"]
    assert "cannot create" in res["infinity"]["skipped"]
    assert meta["command"] and meta["git"]["commit"] and len(meta["machine"]["loadavg"]) == 3
    assert res["levels"] == [1, 4]
    assert set(res["scenarios"]) == {"one", "many"} and res["scenarios"]["many"]["domains"] == 2
    for sc in ("one", "many"):
        for c in ("1", "4"):
            arms = _points(res, sc)[c]
            # The hot-off arm: a second server with hot encoders off, beside the hot one, in both
            # scenarios (two domains are no more than --hot-encoders 2: both run hot).
            assert set(arms) == {"qswap search", "qswap embeddings", peer.HOT_OFF}
            for pts in arms.values():
                assert len(pts) == 1
                p = pts[0]
                assert p["failed"] == 0 and p["ok"] > 0 and p["qps"] > 0
                assert 0 < p["p50_ms"] <= p["p99_ms"] and len(p["loadavg"]) == 3
        assert res["scenarios"][sc]["rss_bytes"]["qswap"] > 0
        assert res["scenarios"][sc]["rss_bytes"]["qswap_hot_off"] > 0   # what hot sessions cost, beside
        assert "agreement" not in res["scenarios"][sc] and res["scenarios"][sc]["vs_infinity"] == {}
    for sc in ("one", "many"):
        for c in ("1", "4"):
            assert res["scenarios"][sc]["hot_over_off"][c]["median"] > 0
        # Each encoder serves a fair share of the rows, so every one ran hot (merged) before timing.
        assert res["scenarios"][sc]["qswap_hot_wait_s"] >= 0
    md = (out / "README.md").read_text()
    assert "Infinity skipped: cannot create" in md and "| one domain | 4 | qswap embeddings |" in md
    assert "| one domain, qswap hot off |" in md
    assert "hot encoder on / off" in md
    assert (out / "qps.png").stat().st_size > 0 and (out / "p99.png").stat().st_size > 0


def test_one_domain_only_is_refused_in_one_line(tiny_model_dir, tmp_path, capsys):
    assert _quick(tiny_model_dir, tmp_path / "x", "--domains", "1", "--no-infinity") == 2
    err = capsys.readouterr().err
    assert err.strip() == "qswap bench peer: --domains must be at least 2 (the second scenario serves several domains)"
    assert not (tmp_path / "x" / "results.json").exists()


def test_twenty_domains_time_a_settled_server(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("QSWAP_DATA_DIR", str(tmp_path / "data"))
    out = tmp_path / "peer"
    assert _quick(tiny_model_dir, out, "--no-infinity", "--scenarios", "twenty") == 0
    res = json.loads((out / "results.json").read_text())["results"]
    sc = res["scenarios"]["twenty"]
    assert set(res["scenarios"]) == {"twenty"} and sc["domains"] == peer.TWENTY.quick
    # Warmed at the highest level until a round started no build, and the timing kept is one during
    # which nothing was built. (Whether warm-up or a first timing makes the first batch that mixes
    # encoders depends on the machine's load: a thrown-away timing is allowed. That /readyz lists a
    # build while it runs is tested with handshakes in tests/encoders/test_shared_segments.py.)
    for settled in sc["qswap_settled"].values():
        assert settled["rounds"] >= 1 and settled["seconds"] > 0
        assert set(settled["waited_for"]) <= {"segment graph", "one-core segment session", "mixed-batch session",
                                             "merged graph", "shared graph"}
    assert sc["qswap_built_during_timing"] is False and 0 <= sc["qswap_retimed"] <= 3
    assert len(sc["qswap_retimed_for"]) == sc["qswap_retimed"] and all(sc["qswap_retimed_for"])
    assert sc["qswap_warming_after"] == []
    for c in ("1", "4"):
        for pts in sc["levels"][c].values():
            assert pts[0]["failed"] == 0 and pts[0]["qps"] > 0


def test_an_unknown_scenario_is_refused_in_one_line(tiny_model_dir, tmp_path, capsys):
    assert _quick(tiny_model_dir, tmp_path / "x", "--scenarios", "one,both", "--no-infinity") == 2
    assert capsys.readouterr().err.strip() == "qswap bench peer: unknown scenario both: use one, many, twenty"


def test_against_infinity_same_answers_and_ratios(tiny_model_dir, tmp_path, monkeypatch):
    py = usable_python(venv_dir())   # the shared data dir's venv, found before the data dir moves
    if py is None:
        pytest.skip(f"Infinity is not installed in {venv_dir()} (qswap bench peer installs it on first use)")
    monkeypatch.setenv("QSWAP_DATA_DIR", str(tmp_path / "data"))
    out = tmp_path / "peer"
    assert _quick(tiny_model_dir, out, "--infinity-venv", str(py.parent.parent), "--scenarios", "one,many,twenty") == 0
    res = json.loads((out / "results.json").read_text())["results"]
    assert res["infinity"]["version"] and "skipped" not in res["infinity"]
    # Tiny models: every one fits; its memory per model was measured once, on two servers.
    cost = res["scenarios"]["twenty"]["infinity_models"]["cost"]
    assert cost["per_model_bytes"] > 0 and cost == res["scenarios"]["many"]["infinity_models"]["cost"]
    for sc in ("one", "many", "twenty"):
        assert res["scenarios"][sc]["infinity_models"]["served"] == res["scenarios"][sc]["domains"]
    for sc in ("one", "many", "twenty"):
        s = res["scenarios"][sc]
        # Same weights, mean pooling, the same prefix: the two servers embed alike.
        assert s["agreement"]["min_cosine"] >= peer.AGREEMENT_BAR and s["agreement"]["passes"]
        assert set(s["agreement"]["per_domain"]) == {f"d{i}" for i in range(s["domains"])}
        assert s["rss_bytes"]["infinity"] > 0
        for c in ("1", "4"):
            inf = s["levels"][c]["infinity embeddings"][0]
            assert inf["failed"] == 0 and inf["qps"] > 0
            for route in ("qswap search", "qswap embeddings"):
                vs = s["vs_infinity"][c][route]
                assert math.isfinite(vs["qps_ratio"]["median"]) and vs["p99_ratio_qswap_over_infinity"] > 0
                assert isinstance(vs["target_met"], bool)
    assert "Agreement (query embeddings" in (out / "README.md").read_text()


def test_infinity_loads_the_models_that_fit_and_says_where_it_stops():
    mib = 2 ** 20
    cost = {"fixed_bytes": 500 * mib, "per_model_bytes": 1000 * mib}
    assert models_that_fit(20, cost, 30_000 * mib, reserve=4096 * mib) == (20, "")
    assert models_that_fit(20, cost, None) == (20, "")   # memory unknown: all of them
    k, why = models_that_fit(20, cost, 18_000 * mib, reserve=4096 * mib)
    assert k == 13
    assert why == ("20 models need ~20,500 MiB (500 MiB + 1,000 MiB per model, measured); 18,000 MiB were "
                   "available less 4,096 MiB left to the rest of the machine: 13 fit")
    assert models_that_fit(20, cost, 1000 * mib, reserve=0)[0] == 0

"""The guard verdict, the one refusal function, and its light import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import numpy as np

from qswap.errors import GuardRefusedError, InvalidInputError
from qswap.guard import GuardRecord, GuardStatus
from qswap.guard.evaluation import RankingMetrics
from qswap.guard.checks import check_guard, guard_record, sentinel_check
from qswap.guard.sentinels import parse_sentinel
from qswap.guard.stats import holm, paired_compare


def _metrics(ndcg: np.ndarray) -> RankingMetrics:
    return RankingMetrics(queries=len(ndcg), per_query={"ndcg_at_10": list(ndcg), "rr": list(ndcg),
                                                        "pnd_errors": [], "pnd_pairs": []})


def test_paired_compare_uses_scipy_tests():
    from scipy import stats as st
    rng = np.random.default_rng(0)
    b = rng.uniform(0, 1, 200)
    a = b + rng.normal(-0.05, 0.1, 200)
    c = paired_compare(b, a)
    d = a - b
    assert c.n == 200 and c.wins == int((d > 0).sum()) and c.losses == int((d < 0).sum())
    assert c.p_value == st.wilcoxon(d).pvalue and c.p_value < 1e-3 and c.delta < 0
    assert c.sign_p_value == st.binomtest(c.wins, 200).pvalue
    same = paired_compare(b, b.copy())
    assert (same.wins, same.losses, same.p_value, same.sign_p_value) == (0, 0, 1.0, 1.0)


def test_holm_adjustment():
    assert holm([0.01, 0.04, 0.03]) == [0.03, 0.06, 0.06]
    assert holm([0.5, 0.9]) == [1.0, 1.0]            # monotone: never below an earlier step
    assert holm([0.2, 0.01]) == [0.2, 0.02]
    assert holm([]) == []


def test_guard_record_decides_on_paired_tests_with_holm():
    rng = np.random.default_rng(1)
    base = rng.uniform(0, 1, 300)
    noise = base + rng.normal(0, 0.02, 300)                 # no shift: not significant
    worse = base - np.abs(rng.normal(0.05, 0.02, 300))      # every query a little worse
    better = base + np.abs(rng.normal(0.05, 0.02, 300))
    checks = [sentinel_check(n, _metrics(base), _metrics(x)) for n, x in
              (("de", noise), ("fr", better), ("it", worse))]
    rec = guard_record(checks)
    v = {c.name: c.verdict for c in rec.checks}
    assert v == {"de": "unchanged", "fr": "improved", "it": "regressed"} and rec.passed is False
    assert all(c.p_holm >= c.p_value for c in rec.checks)
    assert guard_record(checks[:2]).passed is True
    # A borderline p that one test alone would call significant is not, over three sentinels.
    c = checks[0].model_copy(update={"p_value": 0.03, "delta": -0.01})
    rec = guard_record([c, checks[0].model_copy(update={"name": "x"}), checks[0].model_copy(update={"name": "y"})])
    assert rec.checks[0].p_holm == 0.09 and rec.passed is True
    # Stored and read back (manifest, registry file): the same record.
    assert GuardRecord.of(json.loads(json.dumps(rec.to_json()))) == rec


def test_check_guard_refuses_only_a_failed_guard():
    check_guard(None)
    check_guard(guard_record([]))
    rng = np.random.default_rng(2)
    base = rng.uniform(0, 1, 100)
    rec = guard_record([sentinel_check("it", _metrics(base), _metrics(base - 0.1))])
    with pytest.raises(GuardRefusedError, match="it vs base: n=100") as e:
        check_guard(rec)
    assert "force" in e.value.hint and e.value.guard == rec.to_json()
    with pytest.raises(InvalidInputError):
        check_guard({"checks": []})


def test_guard_module_imports_no_torch_or_numpy():
    code = ("import sys, qswap.guard.checks as g; g.check_guard(None);"
            "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_parse_sentinel_forms(tmp_path):
    s = parse_sentinel(f"beir:{tmp_path}:de-en")
    assert (s.kind, s.path, s.query_lang, s.doc_lang) == ("beir", tmp_path, "de", "en")
    s = parse_sentinel(f"beir:{tmp_path}:fr")
    assert (s.query_lang, s.doc_lang) == ("fr", None)
    s = parse_sentinel(f"beir:{tmp_path}")
    assert (s.path, s.query_lang) == (tmp_path, None)
    s = parse_sentinel("arxiv=triplets:/data/arxiv.jsonl")
    assert (s.name, s.kind, str(s.path)) == ("arxiv", "triplets", "/data/arxiv.jsonl")
    with pytest.raises(InvalidInputError):
        parse_sentinel("xnli:/data")


def test_too_few_queries_decide_nothing_and_the_record_reads_typed():
    """Below the minimum a sentinel's check is 'insufficient_evidence' (left out of Holm), and
    the record's verdict is too, unless another check regressed; readers get attributes."""
    from qswap.guard.checks import judge_sentinel

    rng = np.random.default_rng(3)
    base = rng.uniform(0.3, 1, 100)
    few = judge_sentinel("few", _metrics(base[:6] - 0.3), {"base": _metrics(base[:6])}, n=6, min_queries=20)
    fine = judge_sentinel("fine", _metrics(base), {"base": _metrics(base)}, n=100, min_queries=20)
    rec = guard_record(few + fine, min_queries=20)
    assert rec.verdict == "insufficient_evidence" and rec.passed is False and rec.min_queries == 20
    assert [(c.name, c.verdict, c.n, c.judged) for c in rec.checks] == [
        ("few", "insufficient_evidence", 6, False), ("fine", "unchanged", 100, True)]
    assert rec.checks[1].p_holm == rec.checks[1].p_value          # Holm over the one judged check
    worse = judge_sentinel("worse", _metrics(base - 0.2), {"base": _metrics(base)}, n=100, min_queries=20)
    assert guard_record(few + worse, min_queries=20).verdict == "refused"
    assert guard_record(fine, min_queries=20).verdict == "passed"
    assert isinstance(rec, GuardRecord) and rec.verdict is GuardStatus.INSUFFICIENT
    with pytest.raises(InvalidInputError, match="checks.0.name"):
        check_guard({"passed": False, "checks": [{"degraded": True}]})

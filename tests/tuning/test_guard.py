"""The guard verdict, the one refusal function, and its light import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qswap.errors import GuardRefusedError, InvalidInputError
from qswap.tuning.guard import check_guard, guard_record, make_check, parse_sentinel
from qswap.tuning.stats import compare_counts


def test_guard_record_fails_on_a_significant_degradation():
    ok = make_check("de", "pnd_cos", compare_counts(100, 70, 1000))
    noise = make_check("fr", "pnd_cos", compare_counts(100, 110, 1000))      # Z = +0.73
    bad = make_check("it", "pnd_cos", compare_counts(100, 140, 1000))        # Z = +2.75
    assert guard_record([ok, noise])["passed"] is True
    rec = guard_record([ok, noise, bad])
    assert rec["passed"] is False and [c["degraded"] for c in rec["checks"]] == [False, False, True]


def test_check_guard_refuses_only_a_failed_guard():
    check_guard(None)
    check_guard(guard_record([]))
    rec = guard_record([make_check("it", "pnd_cos", compare_counts(100, 140, 1000))])
    with pytest.raises(GuardRefusedError, match="it \\(pnd_cos, Z=\\+2.75\\)") as e:
        check_guard(rec)
    assert "force" in e.value.hint
    with pytest.raises(InvalidInputError):
        check_guard({"checks": []})


def test_guard_module_imports_no_torch_or_numpy():
    code = ("import sys, qswap.tuning.guard as g; g.check_guard(None);"
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

"""`qswap sentinels make`: seeded samples from BEIR or query logs, loadable by the server."""

from __future__ import annotations

import json

import pytest

from qswap.cli import main
from qswap.errors import InvalidInputError
from qswap.guard.sentinels import load_sentinels


def test_make_from_beir_is_seeded_and_loads(tuning_data, tmp_path, capsys):
    out = tmp_path / "sent"
    excl = tmp_path / "seen.txt"
    excl.write_text("q0\nq1\nq2\n")
    for lang in ("en", "de"):
        assert main(["sentinels", "make", "--beir", str(tuning_data["beir"]), "--lang", lang, "--n", "40",
                     "--seed", "3", "--out", str(out), "--exclude-qids", str(excl)]) == 0
    assert "sentinel de: 40 queries (of 147 available, seed 3)" in capsys.readouterr().out
    sents = {s.name: s for s in load_sentinels(out)}
    assert sorted(sents) == ["de", "en"] and sents["de"].lang == "de"
    assert sents["en"].qids == sents["de"].qids                 # one seed, one sample of shared ids
    assert not {"q0", "q1", "q2"} & set(sents["en"].qids)
    assert all(r == {f"d{q[1:]}": 1} for q, r in zip(sents["en"].qids, sents["en"].qrels))
    first = (out / "en" / "queries.jsonl").read_text()
    main(["sentinels", "make", "--beir", str(tuning_data["beir"]), "--lang", "en", "--n", "40",
          "--seed", "3", "--out", str(out), "--exclude-qids", str(excl)])
    assert (out / "en" / "queries.jsonl").read_text() == first
    main(["sentinels", "make", "--beir", str(tuning_data["beir"]), "--lang", "en", "--n", "40",
          "--seed", "4", "--out", str(out)])
    assert (out / "en" / "queries.jsonl").read_text() != first
    assert json.loads((out / "en" / "sentinel.json").read_text())["seed"] == 4


def test_make_from_logs_and_bad_input(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text('{"query": "chess engine", "relevant": ["d1"]}\n'
                   '{"query": "audio editor", "relevant": {"d2": 2, "d3": 0}, "id": "x"}\n')
    assert main(["sentinels", "make", "--log", str(log), "--name", "support", "--out", str(tmp_path / "s")]) == 0
    [s] = load_sentinels(tmp_path / "s")
    assert s.name == "support" and s.qids == ["log-1", "x"] and s.qrels == [{"d1": 1}, {"d2": 2}]
    log.write_text('{"query": "chess", "relevant": []}\n')
    assert main(["sentinels", "make", "--log", str(log), "--out", str(tmp_path / "t")]) == 2
    assert "log.jsonl:1: field 'relevant'" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInputError, match="holds no sentinel folder"):
        load_sentinels(tmp_path / "empty")

"""Readers report bad data with file and line; splits are seeded and disjoint."""

from __future__ import annotations

import gzip
import json

import pytest

from qswap.errors import InvalidInputError, NotFoundError
from qswap.tuning.data import read_beir, read_triplets, split_samples


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_reads_the_sentence_transformers_format(tmp_path):
    f = _write(tmp_path / "t.jsonl", [json.dumps({"query": "q1", "pos": ["p1", "p1b"], "neg": ["n1"]}), "",
                                       json.dumps({"query": "q2", "pos": "p2", "neg": []})])
    s = read_triplets(f)
    assert [(x.query, x.positives, x.negatives) for x in s] == [("q1", ["p1", "p1b"], ["n1"]), ("q2", ["p2"], [])]
    assert s[1].where == "t.jsonl:3"


def test_gzip_input(tmp_path):
    f = tmp_path / "t.jsonl.gz"
    with gzip.open(f, "wt") as g:
        g.write(json.dumps({"query": "q", "pos": ["p"], "neg": ["n"]}) + "\n")
    assert read_triplets(f)[0].negatives == ["n"]


def test_empty_file(tmp_path):
    with pytest.raises(InvalidInputError, match="is empty"):
        read_triplets(_write(tmp_path / "e.jsonl", ["", "  "]))


def test_missing_file(tmp_path):
    with pytest.raises(NotFoundError):
        read_triplets(tmp_path / "nope.jsonl")


def test_bad_lines_are_reported_with_line_numbers(tmp_path):
    f = _write(tmp_path / "bad.jsonl", [
        json.dumps({"query": "ok", "pos": ["p"], "neg": ["n"]}),
        json.dumps({"pos": ["p"]}),                         # 2: no query
        json.dumps({"query": "q", "neg": ["n"]}),           # 3: no pos
        json.dumps({"query": "q", "pos": [], "neg": ["n"]}),  # 4: no positive
        "{not json",                                        # 5
        json.dumps(["a", "list"]),                          # 6
        json.dumps({"query": "q", "pos": ["p", ""]}),       # 7: empty positive
    ])
    with pytest.raises(InvalidInputError) as e:
        read_triplets(f)
    msg = str(e.value)
    for needle in ("bad.jsonl:2: missing field 'query'", "bad.jsonl:3: missing field 'pos'",
                   "bad.jsonl:4: query has no positive", "bad.jsonl:5: not valid JSON",
                   "bad.jsonl:6: expected a JSON object"):
        assert needle in msg
    assert "6 bad line(s)" in msg and "(and 1 more)" in msg and "bad.jsonl:1" not in msg


def test_missing_negatives_only_matter_when_required(tmp_path):
    f = _write(tmp_path / "n.jsonl", [json.dumps({"query": "q", "pos": ["p"]})])
    assert read_triplets(f)[0].negatives == []
    with pytest.raises(InvalidInputError, match="n.jsonl:1: query has no negative"):
        read_triplets(f, require_negatives=True)


def test_splits_are_seeded_disjoint_and_complete(tmp_path):
    f = _write(tmp_path / "s.jsonl", [json.dumps({"query": f"q{i}", "pos": ["p"]}) for i in range(50)])
    samples = read_triplets(f)
    a, b, c = split_samples(samples, 0.1, 10, seed=3), split_samples(samples, 0.1, 10, seed=3), \
        split_samples(samples, 0.1, 10, seed=4)
    assert a.sizes() == {"train": 35, "validation": 5, "test": 10}
    q = lambda xs: [x.query for x in xs]  # noqa: E731
    assert q(a.train) == q(b.train) and q(a.test) == q(b.test)
    assert q(a.test) != q(c.test)
    allq = q(a.train) + q(a.validation) + q(a.test)
    assert sorted(allq) == sorted(q(samples))
    with pytest.raises(InvalidInputError):
        split_samples(samples, 25, 25)


def test_beir_per_language_layout(tuning_data):
    en = read_beir(tuning_data["beir"], "en")
    de = read_beir(tuning_data["beir"], "de")
    assert len(en.corpus_ids) == 150 and len(en.samples()) == 150
    s_en, s_de = en.samples()[0], de.samples()[0]
    assert s_en.qid == s_de.qid and s_en.positive_ids == ["d0"] and s_en.query != s_de.query


def test_beir_bad_qrels_line(tmp_path):
    (tmp_path / "qrels").mkdir()
    _write(tmp_path / "corpus.jsonl", [json.dumps({"_id": "d1", "text": "x"})])
    _write(tmp_path / "queries.jsonl", [json.dumps({"_id": "q1", "text": "y"})])
    _write(tmp_path / "qrels" / "test.tsv", ["query-id\tcorpus-id\tscore", "q1\td1"])
    with pytest.raises(InvalidInputError, match="test.tsv:2: expected 3 tab-separated columns"):
        read_beir(tmp_path)


def test_beir_adapter_titles_and_dangling_qrels(tmp_path):
    """read_beir is not strict (dangling qrels rows are dropped) and embeds title + text."""
    (tmp_path / "qrels").mkdir()
    _write(tmp_path / "corpus.jsonl", [json.dumps({"_id": "d1", "title": "T", "text": "x"}),
                                       json.dumps({"_id": "d2", "text": "y"})])
    _write(tmp_path / "queries.jsonl", [json.dumps({"_id": q, "text": f"text {q}"}) for q in ("q3", "q1", "q2")])
    _write(tmp_path / "qrels" / "test.tsv", ["q1\td1\t1", "q1\tgone\t1", "q2\td2\t0", "q3\td2\t1", "ghost\td1\t1"])
    data = read_beir(tmp_path)
    assert data.corpus_ids == ["d1", "d2"] and data.corpus_texts == ["T x", "y"] and data.source == f"{tmp_path.name}[-]"
    samples = data.samples()     # queries-file order; q2 has no positive
    assert [(s.qid, s.positives, s.positive_ids) for s in samples] == [("q3", ["y"], ["d2"]), ("q1", ["T x"], ["d1"])]

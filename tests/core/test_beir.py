"""The one BEIR reader: layouts, languages, gzip, titles, strictness, bad lines with numbers, writers."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from qswap.beir import (
    QRELS_HEADER,
    BeirDocument,
    LineErrors,
    available_languages,
    iter_jsonl,
    jsonl_line,
    load_beir,
    read_corpus,
    read_qrels,
    read_queries,
    resolve_language,
    write_jsonl,
    write_qrels,
)
from qswap.errors import InvalidInputError, NotFoundError


def _jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _tsv(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def standard(tmp_path: Path) -> Path:
    """Standard one-language BEIR layout, header-less qrels, a numeric id, a title."""
    d = tmp_path / "scifact"
    _jsonl(d / "corpus.jsonl", [{"_id": "1", "title": "Title one", "text": "Body one", "metadata": {"y": 2}},
                                {"_id": 2, "title": "", "text": "Body two"}, ""])
    _jsonl(d / "queries.jsonl", [{"_id": "q2", "text": "no qrels"}, {"_id": "q1", "text": "first"},
                                 {"_id": "q3", "text": "third"}])
    _tsv(d / "qrels" / "test.tsv", ["q3\t2\t1", "q1\t1\t1", "q1\t2\t0"])
    return d


@pytest.fixture
def multilingual(tmp_path: Path) -> Path:
    """Per-language layout: shared corpus, a German corpus, queries/qrels per language."""
    d = tmp_path / "deb"
    _jsonl(d / "corpus.jsonl", [{"_id": "a", "text": "apple"}, {"_id": "b", "text": "banana"}])
    _jsonl(d / "corpus-de.jsonl", [{"_id": "a", "text": "Apfel"}, {"_id": "b", "text": "Banane"}])
    for lang, (qa, qb) in {"en": ("red fruit", "yellow fruit"), "de": ("rote Frucht", "gelbe Frucht"),
                           "fr": ("fruit rouge", "fruit jaune")}.items():
        _jsonl(d / f"queries-{lang}.jsonl", [{"_id": "qa", "text": qa}, {"_id": "qb", "text": qb}])
        _tsv(d / "qrels" / f"test-{lang}.tsv", ["query-id\tcorpus-id\tscore", "qa\ta\t1", "qb\tb\t2"])
    return d


# --- layouts and results ----------------------------------------------------------------


def test_standard_layout(standard):
    corpus, queries, qrels = load_beir(standard)
    assert corpus == {"1": ("Title one Body one", {"y": 2, "title": "Title one"}), "2": ("Body two", {})}
    assert isinstance(corpus["1"], BeirDocument) and corpus["1"].text == "Title one Body one"
    # only queries with qrels (as BEIR's loader does), in queries-file order; qrels in file order
    assert list(queries.items()) == [("q1", "first"), ("q3", "third")]
    assert list(qrels.items()) == [("q3", {"2": 1}), ("q1", {"1": 1, "2": 0})]
    # the lower-level readers do not filter
    assert list(read_queries(standard)) == ["q2", "q1", "q3"]
    assert read_qrels(standard) == {"q3": {"2": 1}, "q1": {"1": 1, "2": 0}}
    assert available_languages(standard) == [] and resolve_language(standard, None) is None


def test_title_prepended_by_default_and_kept_in_metadata(standard):
    assert read_corpus(standard, prepend_title=False)["1"] == ("Body one", {"y": 2, "title": "Title one"})
    with_title = read_corpus(standard)
    assert with_title["1"] == ("Title one Body one", {"y": 2, "title": "Title one"})
    assert with_title["2"].text == "Body two"          # an empty title adds nothing, not a space
    assert load_beir(standard).corpus == with_title


def test_per_language_files_and_corpus_fallback(multilingual):
    d = multilingual
    assert available_languages(d) == ["de", "en", "fr"]
    assert resolve_language(d, None) == "en"             # no queries.jsonl: English
    en = load_beir(d)
    assert en.queries == {"qa": "red fruit", "qb": "yellow fruit"} and en.corpus["a"].text == "apple"
    de = load_beir(d, "de")                              # corpus-de.jsonl is preferred
    assert de.queries["qa"] == "rote Frucht" and de.corpus["a"].text == "Apfel" and de.qrels["qb"] == {"b": 2}
    fr = load_beir(d, "fr")                              # no corpus-fr.jsonl: the shared corpus
    assert fr.queries["qa"] == "fruit rouge" and fr.corpus["a"].text == "apple"
    assert load_beir(d, "de", corpus_lang="en").corpus["a"].text == "apple"   # cross-lingual pair
    assert read_corpus(d, "fr")["b"].text == "banana" and read_corpus(d, "de")["b"].text == "Banane"
    assert read_queries(d, "de")["qb"] == "gelbe Frucht"


def test_gzip_files_are_read(tmp_path):
    d = tmp_path / "gz"
    (d / "qrels").mkdir(parents=True)
    assert write_jsonl(d / "corpus.jsonl.gz", [{"_id": "d1", "text": "zipped dokument é"}]) == 1
    assert write_jsonl(d / "queries-en.jsonl.gz", [{"_id": "q1", "text": "query"}]) == 1
    assert write_qrels(d / "qrels" / "test-en.tsv.gz", [("q1", "d1", 1)]) == 1
    assert gzip.decompress((d / "corpus.jsonl.gz").read_bytes()).decode() == '{"_id":"d1","text":"zipped dokument é"}\n'
    assert available_languages(d) == ["en"]
    corpus, queries, qrels = load_beir(d)
    assert corpus == {"d1": ("zipped dokument é", {})} and queries == {"q1": "query"} and qrels == {"q1": {"d1": 1}}
    # a .gz name on a file that is not gzip is a named error, not a traceback
    (d / "corpus.jsonl.gz").write_text('{"_id": "d1", "text": "plain"}\n')
    with pytest.raises(InvalidInputError, match="not a readable gzip file"):
        read_corpus(d)


# --- missing files ------------------------------------------------------------------------


def test_missing_directory_and_files(tmp_path, standard, multilingual):
    with pytest.raises(NotFoundError, match="does not exist"):
        load_beir(tmp_path / "nowhere")
    with pytest.raises(NotFoundError, match="has no corpus.jsonl"):
        load_beir(tmp_path)
    # a language the directory lacks: the error lists the ones it has, before any file is read
    (multilingual / "corpus.jsonl").write_text("{broken\n")
    with pytest.raises(NotFoundError, match="no queries-it.jsonl") as e:
        load_beir(multilingual, "it")
    assert e.value.hint == "languages available: de, en, fr"
    # queries in a language do not silently fall back to another language's plain file
    with pytest.raises(NotFoundError, match="no queries-de.jsonl") as e:
        load_beir(standard, "de")
    assert "give no language" in e.value.hint
    with pytest.raises(NotFoundError, match=r"no qrels/dev.tsv") as e:
        load_beir(standard, split="dev")
    assert e.value.hint == "qrels files there: test.tsv"
    (standard / "corpus.jsonl").unlink()
    with pytest.raises(NotFoundError, match="has no corpus-de.jsonl or corpus.jsonl"):
        read_corpus(standard, "de")


# --- bad lines ------------------------------------------------------------------------------


def test_bad_corpus_lines_are_reported_together_with_line_numbers(tmp_path):
    d = tmp_path / "ds"
    _jsonl(d / "corpus.jsonl", [
        {"_id": "a", "text": "x"},
        '{"_id": "b", "text": ',                     # 2
        {"_id": "a", "text": "again"},               # 3
        {"_id": "c"},                                # 4
        {"text": "no id"},                           # 5
        {"_id": "e", "text": "  ", "title": "T"},    # 6: empty unless the title is embedded
        {"_id": "f", "text": "y", "metadata": [1]},  # 7
        ["not", "an", "object"],                     # 8
    ])
    with pytest.raises(InvalidInputError) as e:
        read_corpus(d, prepend_title=False)
    msg = str(e.value)
    for needle in ("corpus.jsonl:2: not valid JSON", "corpus.jsonl:3: duplicate _id 'a' (first on line 1)",
                   "corpus.jsonl:4: missing field 'text'", "corpus.jsonl:5: missing field '_id'",
                   "corpus.jsonl:6: empty document"):
        assert needle in msg
    assert "7 bad line(s)" in msg and "(and 2 more)" in msg and "corpus.jsonl:1:" not in msg
    _jsonl(d / "corpus.jsonl", [{"_id": "e", "text": "", "title": "Title only"}, {"_id": True, "text": "x"}])
    with pytest.raises(InvalidInputError, match=r"corpus.jsonl:2: field '_id' must be") as e:
        read_corpus(d)
    assert "corpus.jsonl:1" not in str(e.value)        # the title makes line 1 a document


def test_bad_query_lines_non_utf8_and_empty_files(tmp_path):
    d = tmp_path / "ds"
    _jsonl(d / "queries.jsonl", [{"_id": "q", "text": "ok"}, {"_id": "r", "text": ""}, {"_id": "q", "text": "dup"}])
    with pytest.raises(InvalidInputError) as e:
        read_queries(d)
    assert "queries.jsonl:2: field 'text' must be a non-empty string" in str(e.value)
    assert "queries.jsonl:3: duplicate _id 'q'" in str(e.value)
    (d / "queries.jsonl").write_bytes(b'{"_id": "q", "text": "ok"}\n{"_id": "r", "text": "caf\xe9"}\n')
    with pytest.raises(InvalidInputError, match=r"queries.jsonl:2: not UTF-8"):
        read_queries(d)
    (d / "queries.jsonl").write_text("\n  \n")
    with pytest.raises(InvalidInputError, match="is empty"):
        read_queries(d)


def test_bad_qrels_lines(standard):
    q = standard / "qrels" / "test.tsv"
    _tsv(q, ["query-id\tcorpus-id\tscore", "q1\t1", "q1 1 1", "q1\t1\thigh", "q1\t1\t0.5", "q1\t\t1", "q1\t1\t2.0"])
    with pytest.raises(InvalidInputError) as e:
        read_qrels(standard)
    msg = str(e.value)
    for needle in ("test.tsv:2: expected 3 tab-separated columns, got 2", "test.tsv:3: expected 3 tab-separated",
                   "test.tsv:4: score 'high' is not an integer", "test.tsv:5: score '0.5' is not an integer",
                   "test.tsv:6: empty query-id or corpus-id"):
        assert needle in msg
    assert "test.tsv:7" not in msg and "test.tsv:1" not in msg   # "2.0" is a grade; line 1 the header
    _tsv(q, ["query-id\tcorpus-id\tscore", "q1\t1\t2.0", "qid\t2\t1"])   # only line 1 can be a header
    assert read_qrels(standard) == {"q1": {"1": 2}, "qid": {"2": 1}}
    _tsv(q, ["query-id\tcorpus-id\tscore", ""])
    with pytest.raises(InvalidInputError, match="has no judgements"):
        read_qrels(standard)


def test_unknown_query_or_document_strict_and_not(standard):
    _tsv(standard / "qrels" / "test.tsv", ["q1\t1\t1", "q1\tmissing\t1", "nobody\t1\t1", "q3\t2\t1"])
    with pytest.raises(InvalidInputError) as e:
        load_beir(standard)
    msg = str(e.value)
    assert "test.tsv:2: document 'missing' (query 'q1') is not in corpus.jsonl" in msg
    assert "test.tsv:3: query 'nobody' is not in queries.jsonl" in msg and "2 bad line(s)" in msg
    corpus, queries, qrels = load_beir(standard, strict=False)
    assert qrels == {"q1": {"1": 1}, "q3": {"2": 1}} and list(queries) == ["q1", "q3"]
    # nothing left at all is an error even when not strict
    _tsv(standard / "qrels" / "test.tsv", ["nobody\t1\t1", "q1\tmissing\t1"])
    with pytest.raises(InvalidInputError, match="names a query of queries.jsonl and a document"):
        load_beir(standard, strict=False)


def test_line_errors_and_iter_jsonl(tmp_path):
    p = _jsonl(tmp_path / "t.jsonl", [{"a": 1}, "", "[1]", "{x", {"b": 2}])
    errors = LineErrors(p)
    assert list(iter_jsonl(p, errors)) == [(1, {"a": 1}), (5, {"b": 2})]
    assert errors.count == 2
    with pytest.raises(InvalidInputError, match=r"2 bad line\(s\) in .*t.jsonl: t.jsonl:3: expected a JSON object") as e:
        errors.raise_if_any("the hint")
    assert e.value.hint == "the hint"
    LineErrors(p).raise_if_any("nothing recorded: no error")
    with pytest.raises(NotFoundError):
        list(iter_jsonl(tmp_path / "missing.jsonl", LineErrors(p)))


# --- writers ----------------------------------------------------------------------------------


def test_writers_round_trip(tmp_path):
    assert jsonl_line({"b": "é", "a": [1, 2]}) == '{"b":"é","a":[1,2]}\n'
    d = tmp_path / "out"
    (d / "qrels").mkdir(parents=True)
    docs = [{"_id": f"d{i}", "title": f"T{i}", "text": f"text {i}", "metadata": {"i": i}} for i in range(3)]
    assert write_jsonl(d / "corpus.jsonl", docs) == 3
    assert write_jsonl(d / "queries.jsonl", ({"_id": f"q{i}", "text": f"query {i}"} for i in range(3))) == 3
    assert write_qrels(d / "qrels" / "test.tsv", [(f"q{i}", f"d{i}", i + 1) for i in range(3)]) == 3
    assert (d / "qrels" / "test.tsv").read_text().splitlines()[0] == "\t".join(QRELS_HEADER)
    corpus, queries, qrels = load_beir(d)
    assert corpus == {f"d{i}": (f"T{i} text {i}", {"i": i, "title": f"T{i}"}) for i in range(3)}
    assert queries == {f"q{i}": f"query {i}" for i in range(3)} and qrels == {f"q{i}": {f"d{i}": i + 1} for i in range(3)}
    # gzip output is reproducible (no timestamp in the header)
    write_jsonl(tmp_path / "a.jsonl.gz", docs)
    first = (tmp_path / "a.jsonl.gz").read_bytes()
    write_jsonl(tmp_path / "a.jsonl.gz", docs)
    assert (tmp_path / "a.jsonl.gz").read_bytes() == first and gzip.decompress(first).count(b"\n") == 3
    assert first[4:8] == b"\0\0\0\0"                   # the header's MTIME field

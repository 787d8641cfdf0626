from __future__ import annotations

import pytest

from qswap.errors import InvalidInputError, NotFoundError
from qswap.index.corpus import iter_corpus, read_corpus


def test_jsonl_metadata_and_int_ids(tmp_path, jsonl):
    p = jsonl(tmp_path / "c.jsonl", [{"id": 7, "text": "seven", "section": "games", "metadata": {"lang": "en"}},
                                     {"id": "b", "text": "", "tags": ["x"]}])
    recs, bad = read_corpus(p)
    assert not bad
    assert [r.doc.id for r in recs] == ["7", "b"]
    assert recs[0].doc.metadata == {"section": "games", "lang": "en"}
    assert recs[1].doc.text == "" and recs[1].doc.metadata == {"tags": ["x"]}


def test_beir_folder_title_is_embedded_but_not_returned(tmp_path, jsonl):
    (tmp_path / "beir").mkdir()
    jsonl(tmp_path / "beir" / "corpus.jsonl", [{"_id": "a", "title": "Chess", "text": "a board game",
                                                "metadata": {"url": "u"}}])
    (rec,), _ = read_corpus(tmp_path / "beir")
    assert rec.doc.id == "a" and rec.doc.text == "a board game"
    assert rec.doc.metadata == {"title": "Chess", "url": "u"}
    assert rec.embed_text == "Chess a board game"


def test_bom_and_blank_lines(tmp_path, jsonl):
    p = jsonl(tmp_path / "c.jsonl", [b'\xef\xbb\xbf{"id": "a", "text": "x"}\n', b"\n", b"   \n",
                                     b'{"id": "b", "text": "y"}'])
    recs, bad = read_corpus(p)
    assert [r.doc.id for r in recs] == ["a", "b"] and not bad
    assert [r.line for r in recs] == [1, 4]


BAD = [
    (b'{"id": "x", "text": "caf\xe9"}\n', "not valid UTF-8"),
    (b'{"id": "x", "text": \n', "not JSON"),
    (b'["id", "text"]\n', "where an object was expected"),
    (b'{"text": "no id"}\n', 'no "id" field'),
    (b'{"id": "x"}\n', 'no "text" field'),
    (b'{"id": ["x"], "text": "t"}\n', "must be a string or an integer"),
    (b'{"id": "x", "text": 5}\n', '"text" must be a string'),
    (b'{"id": "x", "text": "t", "score": NaN}\n', "not JSON"),
    (b'{"id": "d0", "text": "again"}\n', "duplicate id 'd0' (first on line 1)"),
]


@pytest.mark.parametrize("line,reason", BAD)
def test_bad_line_stop_names_line_number(tmp_path, jsonl, line, reason):
    p = jsonl(tmp_path / "c.jsonl", [{"id": "d0", "text": "ok"}, {"id": "d1", "text": "ok"}, line,
                                     {"id": "d3", "text": "ok"}])
    with pytest.raises(InvalidInputError) as e:
        read_corpus(p, on_bad_line="stop")
    assert "line 3" in e.value.message and reason in e.value.message
    assert "--on-bad-line skip" in e.value.hint


@pytest.mark.parametrize("line,reason", BAD)
def test_bad_line_skip_keeps_the_rest(tmp_path, jsonl, line, reason):
    p = jsonl(tmp_path / "c.jsonl", [{"id": "d0", "text": "ok"}, {"id": "d1", "text": "ok"}, line,
                                     {"id": "d3", "text": "ok"}])
    recs, bad = read_corpus(p, on_bad_line="skip")
    assert [r.doc.id for r in recs] == ["d0", "d1", "d3"]
    assert len(bad) == 1 and bad[0].line == 3 and reason in bad[0].reason


def test_missing_files(tmp_path):
    with pytest.raises(NotFoundError):
        list(iter_corpus(tmp_path / "nope.jsonl"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(NotFoundError, match="corpus.jsonl"):
        list(iter_corpus(tmp_path / "empty_dir"))
    with pytest.raises(InvalidInputError):
        list(iter_corpus(tmp_path, on_bad_line="ignore"))

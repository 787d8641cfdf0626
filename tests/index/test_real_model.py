"""One end-to-end run with the bundled multilingual-e5-small (slow: loads the real model)."""

from __future__ import annotations

import json

import pytest

from qswap.index import DocumentIndex, cli

DOCS = [
    {"id": "chess", "text": "Chess is a board game for two players on a checkered board of 64 squares.",
     "section": "games"},
    {"id": "football", "text": "Association football is a team sport played with a ball by two teams of eleven.",
     "section": "games"},
    {"id": "bread", "text": "Bread is a staple food made from a dough of flour and water, usually baked.",
     "section": "food"},
    {"id": "python", "text": "Python is a high-level programming language that emphasises readability.",
     "section": "tech"},
    {"id": "paris", "text": "Paris est la capitale et la ville la plus peuplée de France.", "section": "places"},
]


@pytest.mark.slow
def test_build_and_search_with_the_bundled_model(tmp_path, jsonl, capsys):
    corpus = jsonl(tmp_path / "corpus.jsonl", DOCS)
    out = tmp_path / "idx"
    assert cli.main(["index", "build", str(corpus), "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["index", "search", str(out), "what is the capital of France", "a game on a board with squares",
                     "--json", "-k", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["hits"][0]["id"] for r in res] == ["paris", "chess"]
    assert cli.main(["index", "search", str(out), "a game with a ball", "--filter", "section=games", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)[0]["hits"]
    assert [h["id"] for h in hits] == ["football", "chess"]
    with DocumentIndex.open(out, read_only=True) as idx:
        assert idx.manifest["build"]["model"] == "multilingual-e5-small"
        assert idx.full_dim == 384 and idx.space.document_prefix == "passage: "

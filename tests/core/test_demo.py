"""`qswap demo`: the tour's files from the bundled demo corpus, in the formats the commands read."""

from __future__ import annotations

import json

from qswap.cli import main
from qswap.demo import TOUR_FILES, demo_documents, write_tour_files


def _rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_tour_files_are_consistent_and_held_out(tmp_path):
    counts = write_tour_files(tmp_path)
    assert set(counts) == set(TOUR_FILES) and counts["corpus.jsonl"] == 400 == len(demo_documents())
    docs = {d["id"]: d for d in _rows(tmp_path / "corpus.jsonl")}
    by_text = {d["text"]: d for d in docs.values()}
    triplets, labelled = _rows(tmp_path / "triplets.jsonl"), _rows(tmp_path / "support-queries.jsonl")
    assert len(triplets) > 250 and len(labelled) == 100
    for t in triplets:
        pos, neg = by_text[t["pos"][0]], by_text[t["neg"][0]]
        assert t["query"] == pos["title"] and pos["section"] != neg["section"]
    trained = {by_text[t["pos"][0]]["id"] for t in triplets}
    for q in labelled:
        assert q["relevant"][0] in docs and q["relevant"][0] not in trained   # sentinels never test on training
    assert write_tour_files(tmp_path) == counts                                 # same again, replaced in place


def test_demo_command(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "t"), "--docs", "40"]) == 0
    assert len(_rows(tmp_path / "t" / "corpus.jsonl")) == 40
    capsys.readouterr()
    assert main(["demo", "--out", str(tmp_path / "u"), "--docs", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qswap: error:")

"""One title rule: the index and tuning embed exactly the same text for every BEIR document."""

from __future__ import annotations

import json

import numpy as np

from qswap.beir import document_text, read_corpus
from qswap.tuning.data import read_beir


def test_index_and_tuning_embed_identical_document_text(tmp_path, tiny_base):
    from qswap.index import build_index
    from qswap.index.corpus import iter_corpus

    rows = [{"_id": "a", "title": "Chess", "text": "an engine with a board"},
            {"_id": "b", "title": "", "text": "audio editor"},
            {"_id": "c", "text": "no title field"},
            {"_id": "d", "title": "Title only", "text": ""},
            {"_id": 7, "title": "Numeric id", "text": "still text", "metadata": {"section": "x"}}]
    (tmp_path / "qrels").mkdir()
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "queries.jsonl").write_text('{"_id": "q", "text": "chess"}\n')
    (tmp_path / "qrels" / "test.tsv").write_text("q\ta\t1\n")
    embedded: list[str] = []

    def spy(texts: list[str]) -> np.ndarray:
        embedded.extend(texts)
        return tiny_base.encode_documents(texts)

    build_index(tmp_path, tmp_path / "idx", spy, tiny_base.space, progress=False).close()
    index_texts = {r.doc.id: r.embed_text for r in iter_corpus(tmp_path)}
    tuning = read_beir(tmp_path)
    tuning_texts = dict(zip(tuning.corpus_ids, tuning.corpus_texts))
    evaluator_texts = {d: doc.text for d, doc in read_corpus(tmp_path).items()}   # BeirEvaluator's reader
    assert index_texts == tuning_texts == evaluator_texts
    assert sorted(embedded) == sorted(tuning_texts.values())       # what the index really embedded
    assert tuning_texts == {"a": "Chess an engine with a board", "b": "audio editor", "c": "no title field",
                            "d": "Title only", "7": "Numeric id still text"}
    assert document_text("", "x") == "x" and document_text("T", "") == "T"

"""Tuning from captured feedback: export to BEIR, click negatives, seen-query bookkeeping."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from qswap.beir import read_qrels
from qswap.errors import InvalidInputError, NotFoundError
from qswap.feedback.export import query_id
from qswap.feedback.store import Feedback, FeedbackStore, Impression
from qswap.index import Document, create_index
from qswap.tuning.cli import register
from qswap.tuning.data import read_beir
from qswap.tuning.feedback import export_feedback
from qswap.tuning.config import SEEN_QUERIES


@pytest.fixture(scope="module")
def captured(tiny_base, tuning_data, tmp_path_factory):
    """An index of the tiny BEIR corpus and a capture store in which every English query was
    searched once and its relevant document clicked at rank 3 (two documents skipped above)."""
    beir = read_beir(tuning_data["beir"], "en")
    tmp = tmp_path_factory.mktemp("fbtune")
    idx = tmp / "index"
    create_index(idx, [Document(i, t) for i, t in zip(beir.corpus_ids, beir.corpus_texts)],
                 tiny_base.encode_documents(beir.corpus_texts), tiny_base.space).close()
    store = FeedbackStore(tmp / "feedback")
    rng = np.random.default_rng(0)
    ids = beir.corpus_ids
    for n, (qid, query) in enumerate(beir.queries.items()):
        rel = next(iter(beir.qrels[qid]))
        others = [d for d in rng.choice(ids, 6, replace=False) if d != rel][:4]
        shown = others[:2] + [rel] + others[2:]
        domain = "games" if n % 5 else "other"
        store.record([Impression(f"r{n}", 0, domain, "base", query, shown)])
        store.add_feedback(f"r{n}", 0, Feedback([rel]))
    store.close()
    return {"index": idx, "feedback": tmp / "feedback", "beir": beir}


def test_export_keeps_the_domain_and_the_skips(captured, tmp_path):
    out = tmp_path / "beir"
    s = export_feedback(captured["feedback"], captured["index"], out, domain="games")
    beir = captured["beir"]
    texts = {query_id(q) for n, q in enumerate(beir.queries.values()) if n % 5}
    assert s.impressions == 120 and s.queries == len(texts)     # one id per distinct text (merged)
    qrels = read_qrels(out, split="test")
    assert set(qrels) == texts
    assert sum(g for r in qrels.values() for g in r.values()) == s.positives >= len(texts)
    q0 = next(q for n, q in enumerate(beir.queries) if n % 5)
    rel = next(iter(beir.qrels[q0]))
    assert qrels[query_id(beir.queries[q0])][rel] == 1
    assert sorted(qrels[query_id(beir.queries[q0])].values())[-1] == 1
    assert 0 in qrels[query_id(beir.queries[q0])].values()      # the documents skipped above the click
    with pytest.raises(NotFoundError):
        export_feedback(tmp_path / "nothing", captured["index"], out)


def test_tune_run_from_feedback(tiny_model_dir, captured, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    out = tmp_path / "enc"
    argv = ["tune", "run", "--base", str(tiny_model_dir), "--feedback", str(captured["feedback"]), "--domain", "games",
            "--index", str(captured["index"]), "--out", str(out), "--cache-dir", str(tmp_path / "cache"),
            "--lr", "3e-3", "--batch-size", "8", "--epoch-batches", "3", "--max-epochs", "2", "--quiet", "--allow-identity"]
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    report = json.loads((out / "report.json").read_text())
    # Every query came with click-model negatives: nothing was mined.
    assert report["data"]["mining"] is None
    exported = tmp_path / "enc.feedback-data"
    qids = set(read_qrels(exported, split="test"))
    seen = set(json.loads((out / SEEN_QUERIES).read_text())["ids"])
    assert seen and seen < qids          # train + validation only: the run's test queries stay unseen
    # A sentinel from the same export, excluding what the run saw, shares no query with training.
    make = parser.parse_args(["sentinels", "make", "--beir", str(exported), "--out", str(tmp_path / "sent"),
                              "--exclude-qids", str(out / SEEN_QUERIES), "--n", "10", "--name", "fb",
                              "--index", str(captured["index"])])
    assert make.func(make) == 0
    sentinel_qids = set(read_qrels(tmp_path / "sent" / "fb", split="test"))
    assert sentinel_qids and not sentinel_qids & seen
    bad = parser.parse_args(argv[:6] + ["--beir", str(exported), "--out", str(tmp_path / "x")])
    with pytest.raises(InvalidInputError):
        bad.func(bad)


def test_feedback_export_cli(captured, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["feedback", "export", "--dir", str(captured["feedback"]), "--index",
                              str(captured["index"]), "--out", str(tmp_path / "b")])
    assert args.func(args) == 0
    n = len({query_id(q) for q in captured["beir"].queries.values()})
    assert f"{n} queries" in capsys.readouterr().out

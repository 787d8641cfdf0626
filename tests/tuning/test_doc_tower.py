"""Tuning's document step runs on the document tower; `tune eval --index` re-embeds nothing."""

from __future__ import annotations

import argparse
import json

import numpy as np

from qswap.encoders.runtime.documents import document_encoder
from qswap.tuning.cli import register
from qswap.tuning.doc_cache import embed_documents

from ..encoders.adapters import make_lora


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="qswap")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_document_step_uses_the_document_tower(tiny_base, tmp_path):
    enc = document_encoder(tiny_base)
    before = enc.docs_embedded
    texts = [f"chess game number {i}" for i in range(7)]
    got = embed_documents(tiny_base, texts, tmp_path, progress=False)
    assert enc.docs_embedded == before + 7
    assert np.abs(got - tiny_base.encode_documents(texts)).max() < 2e-3   # fp16 cache of the same vectors


def test_tune_eval_takes_document_vectors_from_an_index(tiny_base, tiny_model_dir, tuning_data, tmp_path, capsys):
    from qswap.index import build_index

    beir = tuning_data["beir"]
    build_index(beir, tmp_path / "idx", document_encoder(tiny_base), tiny_base.space, progress=False).close()
    enc = make_lora(tiny_base, tmp_path / "enc", "ft", seed=3)
    args = ["tune", "eval", str(enc), "--base", str(tiny_model_dir), "--beir", str(beir), "--include-seen"]
    capsys.readouterr()
    assert cli(*args, "--index", str(tmp_path / "idx"), "--cache-dir", str(tmp_path / "c1")) == 0
    with_index = json.loads(capsys.readouterr().out)
    assert not list((tmp_path / "c1").rglob("*.npy"))          # every document came from the index
    assert cli(*args, "--cache-dir", str(tmp_path / "c2")) == 0
    embedded = json.loads(capsys.readouterr().out)
    assert list((tmp_path / "c2").rglob("*.npy"))
    assert with_index["beir"] == embedded["beir"]   # the same vectors (both fp16), the same scores

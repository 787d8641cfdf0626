"""Documents a qswap index holds take its stored embeddings; mining can search it."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from qswap.errors import SpaceMismatchError
from qswap.index import Document, DocumentIndex, create_index
from qswap.tuning.cli import register
from qswap.tuning.data import read_beir
from qswap.tuning.doc_cache import DocTable, StoredEmbeddings


@pytest.fixture(scope="module")
def beir_index(tiny_base, tuning_data, tmp_path_factory):
    """An index of the tiny BEIR corpus whose stored vectors are *not* what the base computes
    (each document stores its neighbour's embedding), so using them is observable."""
    beir = read_beir(tuning_data["beir"], "en")
    emb = tiny_base.encode_documents(beir.corpus_texts)
    stored = np.roll(emb, 1, axis=0)
    path = tmp_path_factory.mktemp("idx") / "index"
    create_index(path, [Document(i, t) for i, t in zip(beir.corpus_ids, beir.corpus_texts)], stored,
                 tiny_base.space).close()
    return path, beir, stored


def test_stored_embeddings_replace_embedding(tiny_base, beir_index, tmp_path):
    path, beir, stored = beir_index
    idx = DocumentIndex.open(path, read_only=True, expected_space=tiny_base.space)
    table = DocTable()
    for d, t in zip(beir.corpus_ids[:10], beir.corpus_texts[:10]):
        table.add(t, d)
    table.add("a document the index does not hold")
    emb = table.embed(tiny_base, tmp_path / "cache", progress=False, stored=StoredEmbeddings.from_index(idx))
    assert np.abs(emb[:10] - stored[:10]).max() < 2e-3                       # float16 storage
    assert np.abs(emb[10] - tiny_base.encode_documents(["a document the index does not hold"])[0]).max() < 2e-3
    # only the one document the index lacks was embedded (and cached)
    cached = list((tmp_path / "cache" / tiny_base.space.fingerprint).glob("*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["count"] == 1


def test_an_index_of_another_space_is_refused(other_tiny_model_dir, beir_index, tmp_path):
    from qswap.encoders import load_base
    other = load_base(other_tiny_model_dir, device="cpu")
    with pytest.raises(SpaceMismatchError):
        DocumentIndex.open(beir_index[0], read_only=True, expected_space=other.space)
    idx = DocumentIndex.open(beir_index[0], read_only=True)
    table = DocTable()
    table.add("x", beir_index[1].corpus_ids[0])
    with pytest.raises(SpaceMismatchError):
        table.embed(other, tmp_path, progress=False, stored=StoredEmbeddings.from_index(idx))


def test_run_with_an_index(tiny_model_dir, tuning_data, beir_index, tmp_path):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    out = tmp_path / "enc"
    args = parser.parse_args(["tune", "run", "--allow-identity", "--base", str(tiny_model_dir), "--beir", str(tuning_data["beir"]),
                              "--index", str(beir_index[0]), "--mine", "index", "--fn-cutoff", "1.0",
                              "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--lr", "3e-3",
                              "--batch-size", "8", "--epoch-batches", "3", "--max-epochs", "2", "--quiet"])
    assert args.func(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["mining"]["source"] == "index" and report["data"]["mining"]["held_out"]["mined"] == 30
    # the whole corpus came from the index: nothing was embedded or cached
    assert not (tmp_path / "cache").exists()
    # where the time went: every phase of the run, each within the run's own wall time
    phases = report["phases"]
    assert {"load", "documents", "mining", "training", "evaluation"} <= set(phases)
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= report["wall_seconds_total"]


def test_bench_tuning_e2e_records_the_runs_phases(tiny_model_dir, tuning_data, beir_index, tmp_path):
    from qswap.cli import main
    out = tmp_path / "bench"
    tune = (f"--base {tiny_model_dir} --mine index --fn-cutoff 1.0 --lr 3e-3 --batch-size 8 "
            "--epoch-batches 3 --max-epochs 2")
    assert main(["bench", "tuning", "--e2e", "--beir", str(tuning_data["beir"]), "--index", str(beir_index[0]),
                 "--lang", "en", "--eval-langs", "en,de", "--tune-args", tune, "--before", "1920", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())["results"]
    assert {"load", "documents", "mining", "training", "evaluation"} <= set(res["phases"])
    assert res["steps"] > 0 and 0 < sum(res["phases"].values()) <= res["wall_seconds"]
    assert res["command"][-2:] == ["--sentinel", f"de=beir:{tuning_data['beir']}:de"]
    assert "| 1920 |" in (out / "README.md").read_text() and (out / "phases.png").is_file()


def test_recipes_set_the_schedule_and_flags_override_them(tiny_model_dir, tuning_data, beir_index, tmp_path):
    from qswap.tuning.recipes import RECIPES, resolve
    assert resolve("cpu") == {**RECIPES["cpu"], "precision": "fp32", "lr_rule": "none"}
    assert resolve("cpu", lr=1e-3, patience=None)["lr"] == 1e-3
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    for recipe, extra in (("paper", []), ("cpu", ["--patience", "1"])):
        out = tmp_path / recipe
        args = parser.parse_args(["tune", "run", "--allow-identity", "--base", str(tiny_model_dir), "--beir", str(tuning_data["beir"]),
                                  "--index", str(beir_index[0]), "--mine", "index", "--fn-cutoff", "1.0",
                                  "--out", str(out), "--recipe", recipe, "--epoch-batches", "2", "--max-epochs", "1",
                                  "--batch-size", "8", "--quiet", *extra])
        assert args.func(args) == 0
        report = json.loads((out / "report.json").read_text())
        cfg = report["training"]["config"]
        want = {k: v for k, v in RECIPES[recipe].items() if k not in ("freeze_blocks", "precision")}
        want.update({"epoch_batches": 2, "max_epochs": 1, "batch_size": 8, **({"patience": 1} if extra else {})})
        assert {k: cfg[k] for k in want} == want
        # The report records what the recipe resolved to: "auto" precision becomes the one used.
        assert report["recipe"]["name"] == recipe
        assert report["recipe"]["settings"]["precision"] == cfg["precision"] in ("fp32", "bf16")
        assert report["recipe"]["settings"]["freeze_blocks"] == report["method"]["freeze_blocks"] \
            == RECIPES[recipe]["freeze_blocks"]
        assert {k: report["recipe"]["settings"][k] for k in want} == want

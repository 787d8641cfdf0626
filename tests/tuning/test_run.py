"""End to end: a short tune on the tiny model produces a loadable, guarded encoder."""

from __future__ import annotations

import argparse
import json

import pytest

from qswap.encoders import EncoderPool, load_encoder, read_encoder_manifest, save_encoder
from qswap.errors import GuardRefusedError, InvalidInputError
from qswap.tuning.cli import register
from qswap.guard.checks import check_guard

FAST = ["--lr", "3e-3", "--batch-size", "8", "--epoch-batches", "10", "--max-epochs", "5",
        "--patience", "3", "--quiet"]


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="qswap")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_triplets_run_writes_a_loadable_encoder_and_a_failed_guard(tiny_base, tiny_model_dir, tuning_data,
                                                                   tmp_path, capsys, monkeypatch):
    import qswap.tuning.export as export
    saved = []   # the encoder is saved once (a draft, evaluated as saved, then published)
    monkeypatch.setattr(export, "save_encoder", lambda out, **kw: saved.append(out) or save_encoder(out, **kw))
    out = tmp_path / "enc"
    assert cli("tune", "run", "--base", str(tiny_model_dir), "--train", str(tuning_data["train"]),
               "--out", str(out), "--cache-dir", str(tmp_path / "cache"), *FAST,
               "--sentinel", f"same=triplets:{tuning_data['sentinel_same']}",
               "--sentinel", f"lexical=triplets:{tuning_data['sentinel_lexical']}") == 0
    printed = capsys.readouterr().out
    assert "kind partial" in printed and "guard     FAILED" in printed
    assert "queries dropped" not in printed          # nothing dropped: triplets carry their negatives
    art = load_encoder(out, expected_space=tiny_base.space)
    assert art.manifest.kind == "partial" and art.manifest.name == "enc"
    assert len(saved) == 1 and not saved[0].exists()   # the draft was moved into place, not copied
    assert art.manifest.training["best_epoch"] > 0
    assert {"report.json", "report.md", "learning_curves.png"} <= set(art.manifest.files)
    guard = art.manifest.guard
    by_name = {c["name"]: c for c in guard["checks"]}
    # The task moved queries away from lexical matches: that sentinel is significantly worse,
    # the one from the training distribution significantly better.
    assert by_name["lexical"]["degraded"] and by_name["same"]["verdict"] == "improved"
    assert by_name["lexical"]["p_holm"] < 0.05 and by_name["lexical"]["pnd"]["z"] > 1.96
    assert guard["passed"] is False
    with pytest.raises(GuardRefusedError, match="lexical"):
        check_guard(guard)
    report = json.loads((out / "report.json").read_text())
    assert report["artifact_check"]["max_abs_difference"] < 1e-5
    test = report["evaluation"]["test"]
    assert test["metrics"]["pnd_cos"]["tuned"] < test["metrics"]["pnd_cos"]["base"]
    assert report["layers"]["changed_tensors"] > 0
    assert "token" not in report["config"]
    pool = EncoderPool(tiny_base)
    pool.add(art)
    assert pool.encode(["chess puzzle"], [art.key]).shape == (1, tiny_base.dim)


def test_beir_run_with_languages(tiny_base, tiny_model_dir, tuning_data, tmp_path, capsys):
    out = tmp_path / "beir-enc"
    assert cli("tune", "run", "--base", str(tiny_model_dir), "--beir", str(tuning_data["beir"]),
               "--out", str(out), "--cache-dir", str(tmp_path / "cache"), *FAST, "--fn-cutoff", "1.0",
               "--eval-langs", "en,de", "--sentinel", f"beir:{tuning_data['beir']}:de",
               "--name", "debian-test", "--version", "2") == 0
    m = read_encoder_manifest(out)
    assert m.key == "debian-test@2" and "language_matrix.png" in m.files
    report = json.loads((out / "report.json").read_text())
    ml = report["evaluation"]["multilingual"]
    assert ml["query_langs"] == ["en", "de"] and ml["counts"]["pairs"] == 2
    assert report["data"]["split_before_mining"] == {"train": 120, "validation": 15, "test": 15}
    dropped = report["data"]["dropped_without_negative"]
    assert report["data"]["splits"] == {name: n - dropped.get(name, 0)
                                        for name, n in report["data"]["split_before_mining"].items()}
    assert report["data"]["mining"]["held_out"]["mined"] == 30
    r = report["evaluation"]["retrieval"]
    assert r["z_tests"]["pnd_cos"]["total"] > 0 and "ndcg_at_10" in r["metrics"]
    md = (out / "report.md").read_text()
    assert "Languages (query x document)" in md and "language_matrix.png" in md
    # The guard checks the training language itself, on held-out queries, beside the sentinels.
    assert [c["name"] for c in m.guard["checks"]] == ["en (held-out test)", f"{tuning_data['beir'].name}:de->corpus"]
    assert m.guard["checks"][0]["n"] == 15
    seen = json.loads((out / "training_queries.json").read_text())
    assert len(seen["ids"]) == 135 and "training_queries.json" in m.files
    # `tune eval` leaves the trained-on queries out by default (ids shared across languages).
    capsys.readouterr()
    args = ["tune", "eval", str(out), "--base", str(tiny_model_dir), "--beir", str(tuning_data["beir"]),
            "--langs", "en,de", "--cache-dir", str(tmp_path / "cache")]
    assert cli(*args) == 0
    assert json.loads(capsys.readouterr().out)["excluded_seen_queries"] == 135
    assert cli(*args, "--include-seen") == 0
    assert json.loads(capsys.readouterr().out)["excluded_seen_queries"] == 0


def test_unknown_languages_and_sentinels_fail_before_any_work(tiny_model_dir, tuning_data, tmp_path):
    from qswap.errors import NotFoundError
    base_args = ["tune", "run", "--base", str(tiny_model_dir), "--beir", str(tuning_data["beir"]),
                 "--out", str(tmp_path / "x"), "--cache-dir", str(tmp_path / "cache"), *FAST]
    with pytest.raises(NotFoundError, match="queries-xx.jsonl") as e:
        cli(*base_args, "--eval-langs", "en,xx")
    assert "languages available: de, en" in e.value.hint
    with pytest.raises(NotFoundError, match="queries-fr.jsonl"):
        cli(*base_args, "--sentinel", f"beir:{tuning_data['beir']}:fr")
    assert not (tmp_path / "x").exists() and not (tmp_path / "cache").exists()   # nothing was embedded


def test_no_improvement_gives_an_identity_encoder(tiny_model_dir, tuning_data, tmp_path):
    out = tmp_path / "id"
    assert cli("tune", "run", "--base", str(tiny_model_dir), "--train", str(tuning_data["train"]),
               "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--lr", "1e-12",
               "--batch-size", "8", "--epoch-batches", "2", "--max-epochs", "3", "--patience", "1",
               "--quiet", "--allow-identity") == 0
    m = read_encoder_manifest(out)
    assert m.kind == "identity" and m.training["best_epoch"] == 0 and m.guard["passed"] is True
    assert "the encoder is the base model" in (out / "report.md").read_text()


def test_bad_training_file_fails_before_training(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "chess", "pos": []}\n')
    with pytest.raises(InvalidInputError, match="bad.jsonl:1: query has no positive"):
        cli("tune", "run", "--base", str(tiny_model_dir), "--train", str(bad), "--out", str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_plan_command(tiny_model_dir, capsys):
    assert cli("tune", "plan", "--budget", "1e17", "--base", str(tiny_model_dir), "--step-time", "0.5",
               "--json") == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["method"] == "lora" and plan["lora_rank"] == 32
    assert plan["wall_seconds"] == pytest.approx(0.5 * plan["batches"])


def test_eval_command_on_a_saved_encoder(tiny_base, tiny_model_dir, tuning_data, tmp_path, capsys):
    import torch

    from qswap.encoders import save_encoder
    from qswap.tuning.methods import MethodConfig, QueryTower
    tower = QueryTower(tiny_base, MethodConfig("bias"))
    with torch.no_grad():
        for _, p in tower.trainable_parameters():
            p.add_(0.05)
    ex = tower.export(tmp_path)
    save_encoder(tmp_path / "enc", name="b", version="1", kind=ex.kind, space=tiny_base.space, tensors=ex.tensors)
    assert cli("tune", "eval", str(tmp_path / "enc"), "--base", str(tiny_model_dir),
               "--beir", str(tuning_data["beir"]), "--langs", "en,de", "--heatmap", str(tmp_path / "h.png"),
               "--triplets", str(tuning_data["sentinel_same"]),
               "--sentinel", f"triplets:{tuning_data['sentinel_lexical']}",
               "--cache-dir", str(tmp_path / "cache")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["encoder"] == "b@1" and out["beir"]["counts"]["pairs"] == 2
    assert out["triplets"]["z_tests"]["pnd_cos"]["total"] == 40
    assert len(out["guard"]["checks"]) == 1 and (tmp_path / "h.png").exists()


def test_a_run_without_an_improving_epoch_says_so_and_exits_nonzero(tiny_model_dir, tuning_data, tmp_path, capsys):
    """Nothing learned (lr 0): the encoder is the base; --quiet or not, stderr says so and the exit is 3."""
    from qswap.tuning.cli import IDENTITY_EXIT
    argv = ["tune", "run", "--base", str(tiny_model_dir), "--train", str(tuning_data["train"]),
            "--cache-dir", str(tmp_path / "cache"), "--lr", "1e-12", "--batch-size", "8", "--epoch-batches", "2",
            "--max-epochs", "2", "--patience", "1", "--quiet"]
    assert cli(*argv, "--out", str(tmp_path / "a")) == IDENTITY_EXIT
    err = capsys.readouterr().err
    assert "no epoch improved" in err and "--allow-identity" in err
    assert cli(*argv, "--out", str(tmp_path / "b"), "--allow-identity") == 0
    assert "qswap: warning: no epoch improved" in capsys.readouterr().err

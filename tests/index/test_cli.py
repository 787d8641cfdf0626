from __future__ import annotations

import argparse
import json

import pytest

from qswap.encoders.runtime.embedder import Embedder
from qswap.index import cli


@pytest.fixture
def fake_model(monkeypatch, space, embed):
    loaded: list[str] = []

    def load(model, precision="fp32", runtime=None, threads=None):
        loaded.append(model)
        return Embedder(model, space, embed, embed)

    monkeypatch.setattr(cli, "load_embedder", load)
    return loaded


def run(capsys, *argv):
    code = cli.main(["index", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_register_adds_index_subcommands():
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["index", "search", "some/dir", "hello", "--filter", "year=2001", "-k", "3"])
    assert args.func is cli.cmd_search and args.k == 3 and args.filter == ["year=2001"]
    for sub in ("build", "info", "add", "delete", "search", "eval", "reindex"):
        assert parser.parse_args(["index", sub, "x", *(["y"] if sub in ("add", "search") else []),
                                  *(["--out", "o"] if sub == "build" else [])]).index_command == sub


def test_build_info_search_add_delete_eval(tmp_path, corpus, jsonl, capsys, fake_model):
    out = tmp_path / "idx"
    code, stdout, _ = run(capsys, "build", corpus, "--out", out, "--no-progress", "--kind", "hnsw", "--quant", "sq8")
    assert code == 0 and "150 documents, hnsw/sq8/dim 32" in stdout
    assert fake_model == ["multilingual-e5-small"]

    code, stdout, _ = run(capsys, "info", out)
    assert code == 0 and "documents:   150" in stdout and "IDMap2,HNSW32,SQ8" in stdout
    code, stdout, _ = run(capsys, "info", out, "--json")
    assert json.loads(stdout)["build"]["model"] == "multilingual-e5-small"

    code, stdout, _ = run(capsys, "search", out, "document number 4 " + "word " * 4, "-k", "2", "--json")
    hits = json.loads(stdout)[0]["hits"]
    assert code == 0 and hits[0]["id"] == "d4" and hits[0]["metadata"]["section"] == "news"
    code, stdout, _ = run(capsys, "search", out, "anything", "--filter", "section=tech", "--filter", "year=2002",
                          "-k", "50", "--json")
    got = json.loads(stdout)[0]["hits"]
    assert got and all(h["metadata"]["section"] == "tech" and h["metadata"]["year"] == 2002 for h in got)
    assert len(got) == len([i for i in range(150) if i % 3 == 2 and i % 5 == 2])

    new = jsonl(tmp_path / "new.jsonl", [{"id": "n1", "text": "fresh one"}, {"id": "d4", "text": "replaced"}])
    code, _, err = run(capsys, "add", out, new)
    assert code == 2 and "already in the index" in err and "--upsert" in err
    code, stdout, _ = run(capsys, "add", out, new, "--upsert")
    assert code == 0 and "index holds 151" in stdout
    code, stdout, _ = run(capsys, "search", out, "replaced", "-k", "1")
    assert " d4 replaced" in stdout

    code, stdout, _ = run(capsys, "delete", out, "d4", "n1", "nope")
    assert code == 0 and "deleted 2 of 3" in stdout
    code, stdout, _ = run(capsys, "search", out, "replaced", "-k", "200", "--json", "--no-text")
    assert {"d4", "n1"}.isdisjoint(h["id"] for h in json.loads(stdout)[0]["hits"])

    code, stdout, _ = run(capsys, "eval", out, "--n-queries", "50", "--latency-queries", "10")
    assert code == 0 and "recall@10:" in stdout and "p99" in stdout
    code, stdout, _ = run(capsys, "eval", out, "--n-queries", "50", "--latency-queries", "10", "--kind", "flat",
                          "--quant", "fp32", "--json")
    rep = json.loads(stdout)
    assert rep["variant"] and rep["recall@10"] == 1.0 and rep["factory"] == "IDMap2,Flat"
    queries = tmp_path / "q.txt"
    queries.write_text("document number 1\n{\"text\": \"document number 2\"}\n")
    code, stdout, _ = run(capsys, "eval", out, "--queries", queries, "--json", "--latency-queries", "2")
    assert code == 0 and json.loads(stdout)["queries"] == 2

    code, stdout, _ = run(capsys, "reindex", out, "--dim", "16", "--kind", "ivf")
    assert code == 0 and "ivf/sq8/dim 16" in stdout


def test_cli_errors_are_one_line_exit_2(tmp_path, jsonl, records, capsys, fake_model, monkeypatch, other_space,
                                        embed):
    rows = records(5)
    rows.insert(2, b"{not json\n")
    bad = jsonl(tmp_path / "bad.jsonl", rows)
    code, _, err = run(capsys, "build", bad, "--out", tmp_path / "idx", "--no-progress")
    assert code == 2 and "line 3: not JSON" in err and err.count("\n") == 1
    code, stdout, _ = run(capsys, "build", bad, "--out", tmp_path / "idx", "--no-progress", "--on-bad-line", "skip")
    assert code == 0 and "5 documents" in stdout and "1 bad lines skipped" in stdout
    code, _, err = run(capsys, "info", tmp_path / "missing")
    assert code == 2 and "not a qswap index" in err
    code, _, err = run(capsys, "search", tmp_path / "idx", "x", "--filter", "novalue")
    assert code == 2 and "FIELD=VALUE" in err
    code, _, err = run(capsys, "reindex", tmp_path / "idx")
    assert code == 2 and "no index option" in err

    monkeypatch.setattr(cli, "load_embedder", lambda m, **kw: Embedder(m, other_space(weights="f"), embed, embed))
    code, _, err = run(capsys, "search", tmp_path / "idx", "x")
    assert code == 2 and "embedding space differs in weights_sha256" in err


def test_parse_filter_types():
    assert cli.parse_filter(["a=games", "b=2020", "c=true", 'd="2020"', "e=1.5", "f=[1]", "g=x=y"]) == \
        {"a": "games", "b": 2020, "c": True, "d": "2020", "e": 1.5, "f": "[1]", "g": "x=y"}
    assert cli.parse_filter([]) is None


def test_milvus_build_search_add_delete(tmp_path, corpus, jsonl, capsys, fake_model):
    db = tmp_path / "docs.db"
    code, stdout, err = run(capsys, "build", corpus, "--backend", "milvus", "--uri", db, "--collection", "docs",
                            "--no-progress", "--dim", "16")
    assert code == 0, err
    assert "milvus collection 'docs'" in stdout and "150 documents, flat/fp32/dim 16" in stdout
    # a second build into the same collection needs --replace
    code, _, err = run(capsys, "build", corpus, "--backend", "milvus", "--uri", db, "--collection", "docs",
                       "--no-progress")
    assert code == 2 and "--replace" in err
    loc = f"milvus://{db}?collection=docs"
    code, stdout, _ = run(capsys, "info", loc)
    info = json.loads(stdout)
    assert info["documents"] == 150 and info["milvus"]["full_vectors"] and info["dim"] == 16
    code, stdout, _ = run(capsys, "search", loc, "document number 4 " + "word " * 4, "-k", "2", "--json",
                          "--filter", "section=news")
    hits = json.loads(stdout)[0]["hits"]
    assert hits[0]["id"] == "d4" and all(h["metadata"]["section"] == "news" for h in hits)
    more = jsonl(tmp_path / "more.jsonl", [{"id": "x1", "text": "extra"}])
    code, stdout, _ = run(capsys, "add", loc, more)
    assert code == 0 and "index holds 151" in stdout
    code, stdout, _ = run(capsys, "delete", loc, "x1", "d1", "nope")
    assert code == 0 and "deleted 2 of 3" in stdout
    # the wrong flags for a backend are a one-line error
    code, _, err = run(capsys, "build", corpus, "--backend", "milvus", "--out", tmp_path / "o")
    assert code == 2 and "--uri and --collection" in err
    code, _, err = run(capsys, "info", f"milvus://{db}?collection=absent")
    assert code == 2 and "no collection 'absent'" in err

from __future__ import annotations

import json

import numpy as np
import pytest

import qswap
from qswap.atomic import sha256_file
from qswap.errors import ConflictError, InvalidInputError
from qswap.index import Document, DocumentIndex, IndexConfig, build_index, create_index
from qswap.index.build import staging_dir


class Interrupt(Exception):
    pass


def test_build_jsonl_manifest_and_search(tmp_path, corpus, embed, space, vec):
    out = tmp_path / "idx"
    idx = build_index(corpus, out, embed, space, IndexConfig(), progress=False, model="fake-model")
    assert idx.count == 150 and idx.dim == idx.full_dim == 32
    m = json.loads((out / "manifest.json").read_text())
    assert m["fingerprint"] == space.fingerprint and m["metric"] == "inner_product"
    assert m["qswap_version"] == qswap.__version__ and m["build"]["model"] == "fake-model"
    assert m["build"]["corpus_sha256"] == sha256_file(corpus) and m["build"]["seconds"] >= 0
    assert m["counts"]["documents"] == 150 and m["config"]["kind"] == "flat"  # small corpus default
    for name, sha in m["files"].items():
        assert sha256_file(out / name) == sha
    assert not staging_dir(out).exists()
    hits = idx.search(vec("document number 7 " + "word " * 7)[None], 3)[0]
    assert hits[0].id == "d7" and hits[0].score == pytest.approx(1.0, abs=2e-3)
    assert hits[0].metadata == {"section": "news", "year": 2002, "hot": False}
    assert hits[0].text.startswith("document number 7")
    idx.close()


def test_build_beir_folder(tmp_path, jsonl, embed, space, vec):
    (tmp_path / "beir").mkdir()
    jsonl(tmp_path / "beir" / "corpus.jsonl",
          [{"_id": f"b{i}", "title": f"T{i}", "text": f"body {i}"} for i in range(20)])
    with build_index(tmp_path / "beir", tmp_path / "idx", embed, space, progress=False) as idx:
        top = idx.search(vec("T3 body 3")[None], 1)[0][0]
        assert top.id == "b3" and top.text == "body 3" and top.metadata["title"] == "T3"


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
@pytest.mark.parametrize("quant", ["fp32", "fp16", "sq8", "sq4", "pq"])
def test_every_kind_and_quant_finds_documents_with_exact_scores(tmp_path, corpus, embed, space, kind, quant):
    cfg = IndexConfig(kind=kind, quant=quant, dim=16, oversample=8, nprobe=64)
    with build_index(corpus, tmp_path / "idx", embed, space, cfg, progress=False) as idx:
        assert idx.dim == 16 and idx.info()["faiss"]["factory"]
        ids, vecs = idx.export_embeddings()
        q = vecs[:20].astype(np.float32)
        hits = idx.search(q, 5)
        exact = idx.search_exact(q, 5)
        found = sum(h[0].id == i for h, i in zip(hits, ids[:20]))
        assert found >= 19, f"{kind}/{quant} found {found}/20"
        for h, e in zip(hits, exact):
            # rescored scores are the exact full-dimension cosines, best first
            assert [x.score for x in h] == sorted([x.score for x in h], reverse=True)
            exact_scores = {x.id: x.score for x in e}
            for x in h:
                if x.id in exact_scores:
                    assert x.score == pytest.approx(exact_scores[x.id], abs=1e-5)


def test_length_sorted_batches(tmp_path, corpus, space, embed):
    seen: list[list[int]] = []

    def recording(texts):
        seen.append([len(t) for t in texts])
        return embed(texts)

    build_index(corpus, tmp_path / "idx", recording, space, IndexConfig(batch_size=16), progress=False).close()
    flat = [n for b in seen for n in b]
    assert flat == sorted(flat) and len(flat) == 150


def test_interrupted_build_resumes_where_it_stopped(tmp_path, corpus, space, embed):
    cfg = IndexConfig(batch_size=8, chunk_rows=32)
    calls = {"n": 0}

    def dying(texts):
        calls["n"] += 1
        if calls["n"] > 9:  # 72 texts embedded: chunks 0 and 1 (64 rows) complete, 8 rows of chunk 2
            raise Interrupt()
        return embed(texts)

    with pytest.raises(Interrupt):
        build_index(corpus, tmp_path / "idx", dying, space, cfg, progress=False)
    assert not (tmp_path / "idx").exists()
    assert len(list((staging_dir(tmp_path / "idx") / "chunks").glob("*.f16"))) == 2

    texts_after: list[str] = []

    def counting(texts):
        texts_after.extend(texts)
        return embed(texts)

    with build_index(corpus, tmp_path / "idx", counting, space, cfg, progress=False) as idx:
        assert len(texts_after) == 150 - 72  # resumed at the last whole batch
        assert idx.count == 150 and idx.manifest["build"]["runs"] == 2
        ids, got = idx.export_embeddings()
    with build_index(corpus, tmp_path / "fresh", embed, space, cfg, progress=False) as fresh:
        ids2, want = fresh.export_embeddings()
    assert ids == ids2 and np.array_equal(got, want)


def test_changed_corpus_starts_over(tmp_path, corpus, jsonl, records, space, embed):
    cfg = IndexConfig(batch_size=8, chunk_rows=32)
    calls = {"n": 0}

    def dying(texts):
        calls["n"] += 1
        if calls["n"] > 5:
            raise Interrupt()
        return embed(texts)

    with pytest.raises(Interrupt):
        build_index(corpus, tmp_path / "idx", dying, space, cfg, progress=False)
    jsonl(corpus, records(40))
    n = []
    with build_index(corpus, tmp_path / "idx", lambda t: (n.append(len(t)), embed(t))[1], space, cfg,
                     progress=False) as idx:
        assert idx.count == 40 and sum(n) == 40


def test_bad_line_stop_keeps_existing_index(tmp_path, corpus, jsonl, records, space, embed):
    out = tmp_path / "idx"
    build_index(corpus, out, embed, space, progress=False).close()
    before = (out / "manifest.json").read_bytes()
    rows = records(10)
    rows.insert(4, b"this is not json\n")
    bad = jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(InvalidInputError, match="line 5: not JSON"):
        build_index(bad, out, embed, space, progress=False)
    assert (out / "manifest.json").read_bytes() == before
    assert not staging_dir(out).exists()
    with DocumentIndex.open(out) as idx:
        assert idx.count == 150


def test_bad_lines_skipped_are_recorded(tmp_path, jsonl, records, space, embed):
    rows = records(10)
    rows[2] = b'{"id": "d2", "text": "caf\xe9"}\n'
    rows.append({"id": "d1", "text": "dup"})
    p = jsonl(tmp_path / "c.jsonl", rows)
    with build_index(p, tmp_path / "idx", embed, space, on_bad_line="skip", progress=False) as idx:
        assert idx.count == 9
        b = idx.manifest["build"]
        assert b["n_bad_lines"] == 2 and [x["line"] for x in b["bad_lines"]] == [3, 11]
        assert idx.get(["d1"])[0].text.startswith("document number 1")


def test_empty_corpus_is_an_error_and_writes_nothing(tmp_path, jsonl, space, embed):
    p = jsonl(tmp_path / "c.jsonl", [b"\n"])
    with pytest.raises(InvalidInputError, match="no documents"):
        build_index(p, tmp_path / "idx", embed, space, progress=False)
    assert not (tmp_path / "idx").exists()
    p = jsonl(tmp_path / "c.jsonl", [b"garbage\n", b"[1]\n"])
    with pytest.raises(InvalidInputError, match=r"no documents \(2 bad lines skipped\)"):
        build_index(p, tmp_path / "idx", embed, space, on_bad_line="skip", progress=False)


def test_embed_function_errors_are_named(tmp_path, corpus, space):
    with pytest.raises(InvalidInputError, match="shape"):
        build_index(corpus, tmp_path / "idx", lambda t: np.ones((len(t), 7)), space, progress=False)
    with pytest.raises(InvalidInputError, match="NaN"):
        build_index(corpus, tmp_path / "idx", lambda t: np.full((len(t), 32), np.nan), space, progress=False)


def test_rebuild_replaces_and_refuses_foreign_folder(tmp_path, corpus, jsonl, records, space, embed):
    out = tmp_path / "idx"
    build_index(corpus, out, embed, space, progress=False).close()
    jsonl(corpus, records(30))
    with build_index(corpus, out, embed, space, IndexConfig(kind="hnsw"), progress=False) as idx:
        assert idx.count == 30 and idx.config.kind == "hnsw"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ConflictError, match="not a qswap index"):
        build_index(corpus, tmp_path / "notes", embed, space, progress=False)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_build_refuses_to_replace_an_index_open_for_writing(tmp_path, corpus, space, embed):
    out = tmp_path / "idx"
    held = build_index(corpus, out, embed, space, progress=False)
    with pytest.raises(ConflictError, match="open for writing"):
        build_index(corpus, out, embed, space, progress=False)
    held.close()
    # the finished staging is swapped in by the next run without embedding again
    with build_index(corpus, out, lambda t: pytest.fail("re-embedded"), space, progress=False) as idx:
        assert idx.count == 150


def test_create_index_from_arrays(tmp_path, space, embed):
    docs = [Document(f"x{i}", f"t{i}", {"n": i}) for i in range(12)]
    with create_index(tmp_path / "idx", docs, embed([d.text for d in docs]), space) as idx:
        assert idx.count == 12
        assert idx.search(embed(["t4"]), 1)[0][0].id == "x4"
    with pytest.raises(InvalidInputError):
        create_index(tmp_path / "idx2", docs, embed(["a"]), space)

from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest

from qswap.errors import IntegrityError, NotFoundError, SpaceMismatchError
from qswap.index import Document, DocumentIndex, create_index


@pytest.fixture
def built(tmp_path, space, embed):
    docs = [Document(f"d{i}", f"text {i}", {"n": i}) for i in range(50)]
    create_index(tmp_path / "idx", docs, embed([d.text for d in docs]), space).close()
    return tmp_path / "idx"


def manifest(path):
    return json.loads((path / "manifest.json").read_text())


def test_tampered_embedding_file_is_named(built):
    chunk = manifest(built)["embeddings"]["chunks"][0]["file"]
    data = bytearray((built / chunk).read_bytes())
    data[100] ^= 0xFF
    (built / chunk).write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=chunk.replace(".", r"\.") + ": sha256"):
        DocumentIndex.open(built)
    with DocumentIndex.open(built, verify=False) as idx:  # skipping hashes is the caller's choice
        assert idx.count == 50


def test_missing_or_truncated_files(built):
    m = manifest(built)
    (built / m["faiss"]["file"]).unlink()
    with pytest.raises(IntegrityError, match="missing"):
        DocumentIndex.open(built)
    chunk = m["embeddings"]["chunks"][0]["file"]
    (built / chunk).write_bytes(b"\0" * 10)
    with pytest.raises(IntegrityError, match="10 bytes"):
        DocumentIndex.open(built, verify=False)


def test_bad_manifest_and_not_an_index(built, tmp_path):
    with pytest.raises(NotFoundError, match="not a qswap index"):
        DocumentIndex.open(tmp_path / "nowhere")
    (built / "manifest.json").write_text("{ broken")
    with pytest.raises(IntegrityError, match="not valid JSON"):
        DocumentIndex.open(built)


def test_fingerprint_refusal_names_the_field(built, other_space, space):
    with DocumentIndex.open(built, expected_space=space) as idx:
        assert idx.space == space
    with pytest.raises(SpaceMismatchError) as e:
        DocumentIndex.open(built, expected_space=other_space(weights="c"))
    assert e.value.field == "weights_sha256" and "weights_sha256" in e.value.message
    with pytest.raises(SpaceMismatchError) as e:
        DocumentIndex.open(built, expected_space=other_space(dim=64))
    assert e.value.field == "dim"


def test_edited_space_in_manifest(built, space):
    m = manifest(built)
    m["space"]["pooling"] = "cls"  # stored fingerprint no longer matches
    (built / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IntegrityError, match="inconsistent"):
        DocumentIndex.open(built)
    m["space"].pop("fingerprint")  # consistent again, but another space than expected
    (built / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SpaceMismatchError) as e:
        DocumentIndex.open(built, expected_space=space)
    assert e.value.field == "pooling"


def test_document_store_tampering_is_detected(built):
    con = sqlite3.connect(built / "docs.sqlite")
    con.execute("UPDATE docs SET text = 'evil' WHERE id = 'd3'")
    con.commit()
    with pytest.raises(IntegrityError, match="digest"):
        DocumentIndex.open(built)
    con.execute("DELETE FROM docs WHERE id = 'd4'")
    con.commit()
    con.close()
    with pytest.raises(IntegrityError, match="49 live documents, manifest says 50"):
        DocumentIndex.open(built)


def test_leftovers_of_an_interrupted_commit(built, embed):
    gen = manifest(built)["generation"]
    # what a writer killed after its SQLite commit but before its manifest leaves behind
    (built / "emb" / "000000000050-000000000051.g00000099.f16").write_bytes(b"\0" * 64)
    (built / "faiss" / "index.g00000099.faiss").write_bytes(b"junk")
    (built / "emb" / ".000000000050.f16.abc.tmp").write_bytes(b"junk")
    con = sqlite3.connect(built / "docs.sqlite")
    con.execute("INSERT INTO docs(row, id, text, meta, added_gen) VALUES (50, 'ghost', 'boo', '{}', ?)", (gen + 1,))
    con.execute("UPDATE docs SET deleted_gen = ? WHERE id = 'd1'", (gen + 1,))
    con.commit()
    con.close()
    with DocumentIndex.open(built, read_only=True) as ro:  # readers see the committed generation only
        assert ro.count == 50 and ro.get(["ghost", "d1"]) == [None, ro.get(["d1"])[0]]
        assert ro.get(["d1"])[0] is not None
    with DocumentIndex.open(built) as idx:  # the next writer rolls back and cleans up
        assert idx.count == 50 and idx.get(["ghost"]) == [None]
        assert sorted(p.name for p in (built / "emb").iterdir()) == \
            [manifest(built)["embeddings"]["chunks"][0]["file"].split("/")[1]]
        assert len(list((built / "faiss").iterdir())) == 1
        idx.add([Document("ghost", "real now", {})], embed(["real now"]))
        assert idx.search(embed(["real now"]), 1)[0][0].id == "ghost"
    con = sqlite3.connect(built / "docs.sqlite")
    assert con.execute("SELECT COUNT(*) FROM docs WHERE id = 'ghost'").fetchone()[0] == 1
    con.close()


def test_queries_from_another_space_are_the_callers_check(built, other_space):
    # The index compares spaces, not vectors: callers pass expected_space (the server does).
    with DocumentIndex.open(built) as idx:
        with pytest.raises(SpaceMismatchError):
            idx.space.require_same(other_space(weights="e"), "encoder")
        assert len(idx.search(np.ones((1, 32), np.float32), 3)[0]) == 3


def test_malformed_manifest_fields(built):
    m = manifest(built)
    del m["faiss"]["file"]
    (built / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IntegrityError, match="malformed"):
        DocumentIndex.open(built)

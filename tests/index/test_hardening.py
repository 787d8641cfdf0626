"""Bad input is a named InvalidInputError (never a crash), options merge as given, and an index
held by another process is never rebuilt or written (two real processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from qswap.errors import ConflictError, InvalidInputError
from qswap.index import Document, DocumentIndex, IndexConfig, create_index
from qswap.index.checks import MAX_FILTER_FIELDS
from qswap.index.errors import IndexCorruptError


@pytest.fixture
def idx(tmp_path, space, embed):
    docs = [Document(f"d{i}", f"text {i}", {"section": ("games", "news")[i % 2], "n": i}) for i in range(40)]
    with create_index(tmp_path / "idx", docs, embed([d.text for d in docs]), space) as i:
        yield i


@pytest.mark.parametrize("flt", [{"\udc00": "x"}, {"section": "\udc00"}, {"n": 2 ** 63}, {"n": -(2 ** 63) - 1}],
                         ids=["surrogate-key", "surrogate-value", "above-2^63", "below--2^63"])
def test_bad_filters_are_invalid_input(idx, vec, flt):
    with pytest.raises(InvalidInputError):
        idx.search(vec("q"), 5, filter=flt)
    with pytest.raises(InvalidInputError):
        idx.search_exact(vec("q"), 5, filter=flt)


def test_int64_bounds_still_filter(idx, vec):
    assert idx.search(vec("q"), 5, filter={"n": 2 ** 63 - 1}) == [[]]
    assert [h.id for h in idx.search(vec("q"), 5, filter={"n": 3})[0]] == ["d3"]


def test_many_filter_fields_are_a_clear_input_error_not_corruption(idx, vec):
    flt = {f"f{i}": i for i in range(1000)}
    with pytest.raises(InvalidInputError, match="at most") as e:
        idx.search(vec("q"), 5, filter=flt)
    assert not isinstance(e.value, IndexCorruptError)
    ok = {"section": "games", **{f"f{i}": i for i in range(MAX_FILTER_FIELDS - 1)}}
    assert idx.search(vec("q"), 5, filter=ok) == [[]]


@pytest.mark.parametrize("doc", [Document("d1", "t", {"x": "\udc00"}), Document("\udc00", "t", {}),
                                 Document("ok", "t\udc00", {})], ids=["metadata", "id", "text"])
def test_lone_surrogates_in_upserts_are_refused_and_change_nothing(idx, vec, doc):
    gen = idx.generation
    with pytest.raises(InvalidInputError, match="not valid Unicode"):
        idx.upsert([doc], vec("t")[None])
    assert idx.generation == gen and idx.count == 40


def test_lone_surrogate_in_delete_ids_is_refused(idx):
    with pytest.raises(InvalidInputError, match="not valid Unicode"):
        idx.delete(["d1", "\udc00"])
    assert idx.count == 40


def test_reindex_merges_any_given_value_and_keeps_build_options_out(idx):
    idx.reindex(IndexConfig(use_gpu=False))
    assert idx.config.use_gpu is False
    idx.reindex(IndexConfig(use_gpu=True))  # the class default still counts when given
    assert idx.config.use_gpu is True
    idx.reindex(IndexConfig(kind="hnsw", batch_size=7, chunk_rows=9))
    assert idx.config.kind == "hnsw"
    m = json.loads((idx.path / "manifest.json").read_text())
    assert "batch_size" not in m["config"] and "chunk_rows" not in m["config"]
    idx.reindex(IndexConfig(kind="flat"))  # an unset option keeps its value
    assert idx.config.use_gpu is True and idx.config.kind == "flat"


def test_corrupt_index_is_named_server_side_error(tmp_path, space, embed):
    docs = [Document(f"d{i}", f"text {i}", {}) for i in range(5)]
    create_index(tmp_path / "i", docs, embed([d.text for d in docs]), space).close()
    (tmp_path / "i" / "manifest.json").write_text("{")
    with pytest.raises(IndexCorruptError):
        DocumentIndex.open(tmp_path / "i")


HOLDER = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    from qswap.encoders.base import load_base
    from qswap.server.demo import open_demo_index
    idx = open_demo_index(load_base(Path(sys.argv[1]), device="cpu"), Path(sys.argv[2]))
    print("ready", idx.generation, flush=True)
    sys.stdin.read()  # hold the index until the parent closes our stdin
''')


@pytest.mark.slow  # two processes each load a (tiny) model and the demo corpus is embedded once
def test_second_server_never_rebuilds_a_held_demo_index(tmp_path, tiny_model_dir, other_tiny_model_dir):
    from qswap.encoders.base import load_base
    from qswap.server.demo import open_demo_index

    out = tmp_path / "demo" / "index"
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    p = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir), str(out)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("ready"), p.stderr.read()
        before = {f.name: f.stat().st_mtime_ns for f in out.rglob("*") if f.is_file() and f.name != ".lock"}
        # Same model: served read-only, nothing written.
        with open_demo_index(load_base(tiny_model_dir, device="cpu"), out) as idx:
            assert idx.info()["read_only"] and idx.count > 0
            with pytest.raises(InvalidInputError, match="read-only"):
                idx.delete(["anything"])
        # Another model (another space): refused, naming the holder; the index is untouched.
        with pytest.raises(ConflictError, match=f"held by process {p.pid}"):
            open_demo_index(load_base(other_tiny_model_dir, device="cpu"), out)
        after = {f.name: f.stat().st_mtime_ns for f in out.rglob("*") if f.is_file() and f.name != ".lock"}
        assert after == before
        assert not (out.parent / "index.building").exists()
    finally:
        p.stdin.close()
        p.wait(timeout=30)


def test_corpus_line_with_an_escaped_lone_surrogate_is_a_bad_line(tmp_path, space, embed, jsonl):
    from qswap.index import build_index
    corpus = jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "fine"}, b'{"id": "b", "text": "bad \\udc00"}\n',
                                          {"id": "c", "text": "also fine"}])
    with pytest.raises(InvalidInputError, match="line 2"):
        build_index(corpus, tmp_path / "idx", embed, space, progress=False)
    with build_index(corpus, tmp_path / "idx", embed, space, on_bad_line="skip", progress=False) as idx:
        assert idx.count == 2 and idx.info()["build"]["n_bad_lines"] == 1

"""``qswap index`` processes on a warm data directory start without torch: once the first command
has exported the base to ONNX and recorded its layout, ``index build`` and ``index search`` on the
ONNX runtime import neither ``transformers``' modelling code nor torch, and answer as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import write_jsonl

HEAVY = ("torch", "transformers", "transformers.models.bert.modeling_bert")
# Runs the real CLI entry point in a fresh process, then says which heavy modules it imported.
WRAPPER = ("import json, sys\nfrom qswap.cli import main\nrc = main(sys.argv[1:])\n"
           f"print(json.dumps({{'rc': rc, 'heavy': sorted(m for m in {HEAVY!r} if m in sys.modules)}}))")
DOCS = [{"id": f"d{i}", "text": t} for i, t in enumerate([
    "chess engine with a graphical board", "audio player for podcasts and radio", "a mail client for the terminal",
    "video editor with effects and transitions", "a compiler for a small functional language",
    "spreadsheet with charts and macros", "photo manager that tags faces", "network monitor drawing graphs",
    "a game of go against the computer", "backup tool that deduplicates files"])]
QUERIES = ["chess board game", "listen to podcasts", "edit a video"]


def _qswap(data_dir: Path, *argv: str, cwd: Path) -> tuple[dict, str]:
    """Run ``qswap ARGV`` in a fresh process; its report and its standard output."""
    env = {**os.environ, "QSWAP_DATA_DIR": str(data_dir)}
    r = subprocess.run([sys.executable, "-c", WRAPPER, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    *out, report = r.stdout.strip().splitlines()
    res = json.loads(report)
    assert res["rc"] == 0, r.stderr[-3000:]
    return res, "\n".join(out)


def _model_of(idx: Path) -> str:
    from qswap.index import DocumentIndex

    with DocumentIndex.open(idx, read_only=True) as i:
        return str(i.manifest["build"]["model"])


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, Path, Path, dict]:
    """A data directory after one ``index build`` (the base exported, its layout recorded), the index
    it built, the corpus, and that first build's report."""
    tmp = tmp_path_factory.mktemp("cli-start")
    corpus = write_jsonl(tmp / "corpus.jsonl", DOCS)
    first, _ = _qswap(tmp / "data", "index", "build", str(corpus), "--out", str(tmp / "idx"), "--model",
                      str(tiny_model_dir), "--no-progress", cwd=tmp)
    return tmp / "data", tmp / "idx", corpus, first


def test_a_warm_search_imports_no_torch_and_answers_as_torch(warm, tmp_path):
    data, idx, _, first = warm
    assert "transformers.models.bert.modeling_bert" in first["heavy"]   # the first run builds and exports
    res, out = _qswap(data, "index", "search", str(idx), *QUERIES, "-k", "4", "--json", cwd=tmp_path)
    assert res["heavy"] == []
    ref, ref_out = _qswap(data, "index", "search", str(idx), *QUERIES, "-k", "4", "--json", "--runtime", "torch",
                          cwd=tmp_path)
    assert "transformers.models.bert.modeling_bert" in ref["heavy"]
    got, want = json.loads(out), json.loads(ref_out)
    assert [[h["id"] for h in q["hits"]] for q in got] == [[h["id"] for h in q["hits"]] for q in want]
    for q, r in zip(got, want):
        assert [h["score"] for h in q["hits"]] == pytest.approx([h["score"] for h in r["hits"]], abs=1e-5)


def test_a_warm_build_imports_no_torch_and_embeds_as_the_first(warm, tmp_path):
    """A second build on the warm data directory embeds on the cached export: the same vectors, bitwise."""
    import numpy as np

    from qswap.index import DocumentIndex

    data, idx, corpus, _ = warm
    res, _ = _qswap(data, "index", "build", str(corpus), "--out", str(tmp_path / "again"), "--no-progress",
                    "--model", _model_of(idx), cwd=tmp_path)
    assert res["heavy"] == []
    ids = [d["id"] for d in DOCS]
    with DocumentIndex.open(idx, read_only=True) as a, DocumentIndex.open(tmp_path / "again", read_only=True) as b:
        assert a.space == b.space
        assert np.array_equal(a.get_embeddings(ids), b.get_embeddings(ids))


def test_index_help_and_import_need_no_torch(tmp_path):
    code = ("import sys, contextlib, io\nimport qswap.index\nfrom qswap.cli import build_parser\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "    build_parser(['index', 'search', '--help']).parse_args(['index', 'search', '--help'])\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"

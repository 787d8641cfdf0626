"""qswap index build --ray against the local build: same ids, vectors, manifest; resumable."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from qswap.index.build import staging_dir


def _tiny_embed(model_dir: str):
    from qswap.encoders.runtime.embedder import document_embedder
    return document_embedder(model_dir)


def _compare(a_dir: Path, b_dir: Path) -> None:
    from qswap.index import DocumentIndex
    with DocumentIndex.open(a_dir, read_only=True) as a, DocumentIndex.open(b_dir, read_only=True) as b:
        ia, ea = a.export_embeddings()
        ib, eb = b.export_embeddings()
        assert ia == ib and len(ia) == 60
        ea, eb = ea.astype(np.float64), eb.astype(np.float64)
        cos = (ea * eb).sum(1) / (np.linalg.norm(ea, axis=1) * np.linalg.norm(eb, axis=1))
        assert cos.min() >= 0.99999, cos.min()
        ma, mb = a.manifest, b.manifest
        for key in ("space", "config", "fingerprint", "counts", "docstore", "dim", "full_dim"):
            assert ma.get(key) == mb.get(key), key
        same = {k: v for k, v in ma["build"].items() if k not in ("started_at", "seconds", "runs")}
        assert same == {k: v for k, v in mb["build"].items() if k not in ("started_at", "seconds", "runs")}


def test_ray_build_resumes_and_equals_local_build(ray_cluster, caplog, tmp_path, tiny_base, tiny_model_dir,
                                                  ray_corpus):
    """A local build killed after its first chunk is finished on Ray (3 of 4 chunks, 2 actors)."""
    from qswap.index import IndexConfig, build_index
    from qswap.index.ray_build import build_index_on_ray
    cfg = IndexConfig(chunk_rows=16, batch_size=8)
    local = tmp_path / "local"
    build_index(ray_corpus, local, lambda t: tiny_base.encode_documents(t, batch_size=len(t)), tiny_base.space, cfg,
                progress=False, model=str(tiny_model_dir)).close()

    out = tmp_path / "ray"
    calls = {"n": 0}

    def dies_after_one_chunk(texts):
        calls["n"] += 1
        if calls["n"] > 2:   # one chunk of 16 rows = two batches of 8
            raise KeyboardInterrupt
        return tiny_base.encode_documents(texts, batch_size=len(texts))

    with pytest.raises(KeyboardInterrupt):
        build_index(ray_corpus, out, dies_after_one_chunk, tiny_base.space, cfg, progress=False,
                    model=str(tiny_model_dir))
    assert sorted(p.name for p in (staging_dir(out) / "chunks").glob("*.f16")) == ["000000.f16"]
    caplog.set_level("WARNING", logger="qswap.index")
    build_index_on_ray(ray_corpus, out, functools.partial(_tiny_embed, str(tiny_model_dir)), tiny_base.space, cfg,
                       workers=2, cpus_per_worker=0.5, progress=False, model=str(tiny_model_dir)).close()
    assert "resuming build: 16 of 60 documents already embedded" in caplog.text
    _compare(local, out)
    assert json.loads((out / "manifest.json").read_text())["build"]["runs"] == 2


def test_cli_refuses_bad_worker_counts(tmp_path, ray_corpus, tiny_model_dir, capsys):
    from qswap.cli import main
    rc = main(["index", "build", str(ray_corpus), "--out", str(tmp_path / "x"), "--ray", "--workers", "0",
               "--model", str(tiny_model_dir)])
    assert rc == 2 and "--workers" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()

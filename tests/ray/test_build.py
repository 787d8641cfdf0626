"""qswap index build --ray against the local build: same ids, vectors, manifest; resumable."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qswap.index.build import staging_dir


def _tiny_embed(model_dir: str):
    from qswap.index.cli import document_embedder
    return document_embedder(model_dir)


def _compare(a_dir: Path, b_dir: Path) -> None:
    from qswap.index import DocumentIndex
    with DocumentIndex.open(a_dir, read_only=True) as a, DocumentIndex.open(b_dir, read_only=True) as b:
        ia, ea = a.export_embeddings()
        ib, eb = b.export_embeddings()
        assert ia == ib and len(ia) == 60
        cos = (ea.astype(np.float64) * eb.astype(np.float64)).sum(1) / (
            np.linalg.norm(ea.astype(np.float64), axis=1) * np.linalg.norm(eb.astype(np.float64), axis=1))
        assert cos.min() >= 0.99999, cos.min()
        ma, mb = a.manifest, b.manifest
        assert ma["space"] == mb["space"] and ma["config"] == mb["config"] and ma["fingerprint"] == mb["fingerprint"]
        assert ma["counts"] == mb["counts"] and ma["docstore"]["digest"] == mb["docstore"]["digest"]
        assert {k: v for k, v in ma["build"].items() if k not in ("started_at", "seconds", "runs")} == \
            {k: v for k, v in mb["build"].items() if k not in ("started_at", "seconds", "runs")}


def test_ray_build_equals_local_build_and_resumes(ray_cluster, caplog, tmp_path, tiny_base, tiny_model_dir, ray_corpus):
    from qswap.index import IndexConfig, build_index
    from qswap.index.ray_build import build_index_on_ray
    cfg = IndexConfig(chunk_rows=16, batch_size=8)
    local = tmp_path / "local"
    build_index(ray_corpus, local, lambda t: tiny_base.encode_documents(t, batch_size=len(t)), tiny_base.space, cfg,
                progress=False, model=str(tiny_model_dir)).close()
    make = functools.partial(_tiny_embed, str(tiny_model_dir))
    on_ray = tmp_path / "ray"
    build_index_on_ray(ray_corpus, on_ray, make, tiny_base.space, cfg, workers=2, cpus_per_worker=0.5,
                       progress=False, model=str(tiny_model_dir)).close()
    _compare(local, on_ray)

    # Resume: a local build killed after two of four chunks, finished on Ray.
    resumed = tmp_path / "resumed"
    calls = {"n": 0}

    def dies_after_two_chunks(texts):
        calls["n"] += 1
        if calls["n"] > 4:   # 2 chunks of 16 rows in batches of 8
            raise KeyboardInterrupt
        return tiny_base.encode_documents(texts, batch_size=len(texts))

    with pytest.raises(KeyboardInterrupt):
        build_index(ray_corpus, resumed, dies_after_two_chunks, tiny_base.space, cfg, progress=False,
                    model=str(tiny_model_dir))
    chunks = sorted(p.name for p in (staging_dir(resumed) / "chunks").glob("*.f16"))
    assert chunks == ["000000.f16", "000001.f16"]
    caplog.set_level("WARNING", logger="qswap.index")
    build_index_on_ray(ray_corpus, resumed, make, tiny_base.space, cfg, workers=1, cpus_per_worker=0.5,
                       progress=False, model=str(tiny_model_dir)).close()
    _compare(local, resumed)
    assert "resuming build: 32 of 60 documents already embedded" in caplog.text
    with open(resumed / "manifest.json") as f:
        assert json.load(f)["build"]["runs"] == 2


def test_cli_refuses_bad_worker_counts(tmp_path, ray_corpus, tiny_model_dir):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    r = subprocess.run([sys.executable, "-m", "qswap.cli", "index", "build", str(ray_corpus), "--out",
                        str(tmp_path / "x"), "--ray", "--workers", "0", "--model", str(tiny_model_dir)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--workers" in r.stderr
    assert not (tmp_path / "x").exists()

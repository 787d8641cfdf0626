"""The peak-RSS arm of ``qswap bench embed``: real ``qswap index build`` child processes."""

from __future__ import annotations

import os
from pathlib import Path

from qswap.bench.embed_arms import build_rss


def test_build_rss_measures_each_size_in_its_own_process(tiny_model_dir: Path, tmp_path: Path):
    import numpy as np

    from qswap.bench.processes import rss_bytes
    texts = ["chess puzzle game for two players", "a linux network server tool", "music audio video player"]
    # This process grows well past a tiny build's peak: the child's figure must not include it
    # (ru_maxrss survives fork + exec, so a child reading its own would report ours).
    ballast = np.ones(1536 << 17, dtype=np.float64)   # 1.5 GiB, touched
    parent = rss_bytes(os.getpid())
    out = build_rss(texts, [30, 120], str(tiny_model_dir), tmp_path)
    del ballast
    assert set(out) == {"30", "120"}
    for rec in out.values():
        assert "error" not in rec, rec
        assert rec["peak_rss_mib"] > 50 and rec["docs_per_s"] > 0   # a Python process with torch loaded
        assert rec["peak_rss_mib"] * (1 << 20) < parent - (1 << 30), (rec, parent)
    assert not list(tmp_path.glob("rss-*")), "corpora and indexes are removed after each build"


def test_build_rss_reports_a_failed_build(tmp_path: Path):
    out = build_rss(["x"], [5], str(tmp_path / "no-such-model"), tmp_path)
    assert "error" in out["5"] and out["5"]["error"]

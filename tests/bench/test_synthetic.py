"""Synthetic clustered embeddings and their exact ground truth."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qswap.bench.data import synthetic
from qswap.bench.data.synthetic import clustered_embeddings, exact_ground_truth
from qswap.errors import InvalidInputError


def _brute_force(base: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    scores = queries.astype(np.float64) @ base.astype(np.float64).T
    ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, ids, axis=1), ids


def test_ground_truth_matches_brute_force():
    base = clustered_embeddings(3000, dim=32, n_clusters=20, seed=1)
    queries = clustered_embeddings(50, dim=32, n_clusters=20, seed=1, stream="queries")
    want_s, want_i = _brute_force(base, queries, 10)
    # chunks smaller than k and not dividing n exercise the merge across chunks
    for chunk in (7, 999, 100_000):
        got_s, got_i = exact_ground_truth(base, queries, k=10, chunk=chunk)
        assert got_i.dtype == np.int64 and got_s.dtype == np.float32 and got_i.shape == (50, 10)
        np.testing.assert_allclose(got_s, want_s, atol=1e-5)
        # ids equal except where two scores tie within float32 rounding
        mismatch = got_i != want_i
        assert np.all(np.abs(got_s - want_s)[mismatch] < 1e-5)
        assert mismatch.mean() < 0.01


def test_ground_truth_orders_ties_by_id():
    base = np.tile(np.eye(4, dtype=np.float32), (3, 1))  # ids 0, 4, 8 are the same vector
    got_s, got_i = exact_ground_truth(base, np.eye(4, dtype=np.float32)[:1], k=3, chunk=5)
    assert got_i.tolist() == [[0, 4, 8]] and got_s.tolist() == [[1.0, 1.0, 1.0]]


def test_embeddings_are_unit_clustered_and_deterministic():
    x = clustered_embeddings(5000, dim=64, n_clusters=8, seed=3, noise=0.6)
    assert x.dtype == np.float32 and x.shape == (5000, 64)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(x, clustered_embeddings(5000, dim=64, n_clusters=8, seed=3, noise=0.6))
    assert not np.array_equal(x, clustered_embeddings(5000, dim=64, n_clusters=8, seed=4, noise=0.6))
    # Clustered: every point is close to one centre (cos ~ 1/sqrt(1+0.6^2) = 0.86), and
    # far from the others (random centres in 64-d are nearly orthogonal).
    centres, probs = synthetic.cluster_model(64, 8, 3)
    sims = x @ centres.T
    top = np.sort(sims, axis=1)
    assert np.median(top[:, -1]) > 0.8 and np.median(top[:, -2]) < 0.5
    assert abs(probs.sum() - 1) < 1e-9


def test_queries_are_held_out_from_the_same_distribution():
    base = clustered_embeddings(2000, dim=48, n_clusters=10, seed=0)
    queries = clustered_embeddings(200, dim=48, n_clusters=10, seed=0, stream="queries")
    assert not np.isin(queries.round(5).view([("", queries.dtype)] * 48), base.round(5).view([("", base.dtype)] * 48)).any()
    # same centres: each query's nearest neighbour is as close as a base point's is
    nn_q = (queries @ base.T).max(axis=1)
    nn_b = np.sort(base[:200] @ base.T, axis=1)[:, -2]  # -1 is the point itself
    assert abs(np.median(nn_q) - np.median(nn_b)) < 0.05


def test_memmap_output_matches_in_memory(tmp_path):
    n = synthetic.BLOCK + 123  # two generation blocks
    path = tmp_path / "base.npy"
    mm = clustered_embeddings(n, dim=16, n_clusters=4, seed=2, path=path)
    assert isinstance(mm, np.memmap)
    loaded = np.load(path, mmap_mode="r")
    assert loaded.shape == (n, 16)
    np.testing.assert_array_equal(loaded, clustered_embeddings(n, dim=16, n_clusters=4, seed=2))
    # a prefix is the same points: n does not change earlier rows
    np.testing.assert_array_equal(loaded[:100], clustered_embeddings(100, dim=16, n_clusters=4, seed=2))


def test_bad_arguments():
    base = clustered_embeddings(10, dim=8, n_clusters=2)
    with pytest.raises(InvalidInputError, match="k=11"):
        exact_ground_truth(base, base, k=11)
    with pytest.raises(InvalidInputError, match="dimension"):
        exact_ground_truth(base, np.zeros((2, 4), np.float32), k=1)
    with pytest.raises(InvalidInputError, match="noise"):
        clustered_embeddings(10, noise=-1)
    with pytest.raises(InvalidInputError, match="stream"):
        clustered_embeddings(10, stream="test")  # type: ignore[arg-type]


def test_cli_writes_a_loadable_set(tmp_path, capsys):
    from qswap.bench.data.cli import main

    out = tmp_path / "syn"
    argv = ["synthetic", "--out", str(out), "--n", "500", "--queries", "20", "--dim", "16", "--clusters", "5", "--k", "5"]
    assert main(argv) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["n"] == 500 and meta["k"] == 5
    base, queries = np.load(out / "base.npy"), np.load(out / "queries.npy")
    ids = np.load(out / "gt_ids.npy")
    assert ids.shape == (20, 5)
    np.testing.assert_array_equal(ids, _brute_force(base, queries, 5)[1])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("keep")
    assert main(["synthetic", "--out", str(tmp_path / "other"), "--n", "10", "--k", "0"]) == 2
    assert (tmp_path / "other" / "x").read_text() == "keep"

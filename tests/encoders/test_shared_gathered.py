"""Mixed batches as ONE gathered ONNX Runtime call (``SharedBackend(mix="gathered")``): each row's
adapter gathered from a table; the same answers per row as the per-group calls and as torch, for
base rows, bias rows and LoRA rows of two ranks in one batch."""

from __future__ import annotations

import numpy as np
import pytest

from qswap.encoders import BASE_KEY
from qswap.encoders.runtime import shared_export
from qswap.encoders.runtime.shared import SharedBackend
from qswap.encoders.runtime.shared_gathered import GatheredTable
from qswap.errors import InvalidInputError

from .test_shared import MIN_COSINE, TEXTS, _pool, _ready_backend, cosine, encoder_dirs, pool  # noqa: F401 (fixtures)

# LoRA r=4 and r=8 on different layers, bias, base, and a partial encoder (merged export), interleaved.
MIXED = ["l1@1", BASE_KEY, "l2@1", "b1@1", "p1@1", "l2@1", "l1@1", "b1@1", BASE_KEY]


@pytest.fixture(scope="module")
def gathered(pool, tmp_path_factory):
    b = _ready_backend(pool, tmp_path_factory.mktemp("gathered"), mix="gathered")
    yield b
    b.close()


class _Spy:
    """Counts the rows of each gathered call and the per-group calls of a backend (the real ones run)."""

    def __init__(self, backend: SharedBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gathered: list[int] = []
        self.groups = 0
        run, call = GatheredTable.run, backend._call

        def spy_run(table, session, emb, mask, slots):
            self.gathered.append(len(slots))
            return run(table, session, emb, mask, slots)

        def spy_call(*a):
            self.groups += 1
            return call(*a)
        monkeypatch.setattr(GatheredTable, "run", spy_run)
        monkeypatch.setattr(backend, "_call", spy_call)


def test_mixed_batch_is_one_gathered_call_equal_to_groups_and_torch(gathered, pool, tmp_path, monkeypatch):
    assert not gathered.gathered_ready()               # built only once a batch mixes encoders
    first = gathered.encode(TEXTS, MIXED)              # per group meanwhile
    assert gathered.gathered_ready(wait=120)
    spy = _Spy(gathered, monkeypatch)
    got = gathered.encode(TEXTS, MIXED)
    shared_rows = sum(k != "p1@1" for k in MIXED)
    assert sum(spy.gathered) == shared_rows and spy.groups == 0
    assert len(spy.gathered) <= 2                      # one call, or two length buckets at most
    groups = _ready_backend(pool, tmp_path / "groups", mix="groups")
    try:
        per_group = groups.encode(TEXTS, MIXED)
    finally:
        groups.close()
    alone = np.stack([pool.encode([t], [k])[0] for t, k in zip(TEXTS, MIXED)])   # torch, row by row
    assert cosine(got, per_group).min() >= MIN_COSINE
    assert cosine(got, alone).min() >= MIN_COSINE
    assert cosine(first, alone).min() >= MIN_COSINE
    # Each row carries its own encoder: the same text under four encoders differs.
    same = gathered.encode([TEXTS[0]] * 4, ["l1@1", "l2@1", "b1@1", BASE_KEY])
    assert cosine(same[:3], same[3:].repeat(3, 0)).max() < 0.999


def test_one_encoder_keeps_its_bound_call(gathered, monkeypatch):
    assert gathered.gathered_ready(wait=120)
    spy = _Spy(gathered, monkeypatch)
    gathered.encode(TEXTS, ["l2@1"] * len(TEXTS))
    assert spy.groups >= 1 and not spy.gathered


def test_table_grows_in_rank_and_slots_and_frees_discarded_keys(tiny_base, encoder_dirs, tmp_path):
    pool = _pool(tiny_base, encoder_dirs)   # its own pool: discard below must not touch the module's
    b = _ready_backend(pool, tmp_path, mix="gathered")
    try:
        b.encode(TEXTS[:2], ["l1@1", BASE_KEY])          # starts the gathered build
        assert b.gathered_ready(wait=120)
        table = b._gathered[1]
        first = b.encode(TEXTS[:2], ["l1@1", BASE_KEY])   # rank-4 table
        rank4 = table.rank
        b.encode(TEXTS[:3], ["l1@1", "l2@1", "b1@1"])     # rank 8: the table grows, l1 kept
        assert (rank4, table.rank) == (4, 8)
        again = b.encode(TEXTS[:2], ["l1@1", BASE_KEY])
        assert cosine(first, again).min() >= MIN_COSINE
        slot = table.slot("b1@1")
        b.discard("b1@1")
        assert "b1@1" not in table and slot in table._free
    finally:
        b.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_factors_gathered_equal_groups(tiny_base, encoder_dirs, tmp_path, dtype):
    hpool = _pool(tiny_base, encoder_dirs, dtype)
    g, p = _ready_backend(hpool, tmp_path / "g", mix="gathered"), _ready_backend(hpool, tmp_path / "p", mix="groups")
    try:
        g.encode(TEXTS, MIXED)
        assert g.gathered_ready(wait=120)
        assert cosine(g.encode(TEXTS, MIXED), p.encode(TEXTS, MIXED)).min() >= MIN_COSINE
    finally:
        g.close()
        p.close()


def test_a_failed_gathered_export_leaves_mixed_batches_per_group(pool, tmp_path, monkeypatch):
    real = shared_export.export_shared

    def broken(*a, gathered=False, **kw):
        if gathered:
            raise OSError("disk full")
        return real(*a, gathered=gathered, **kw)
    monkeypatch.setattr("qswap.encoders.runtime.shared.export_shared", broken)
    b = _ready_backend(pool, tmp_path, mix="gathered")
    try:
        first = b.encode(TEXTS, MIXED)
        assert not b.gathered_ready(wait=120)
        ref = np.stack([pool.encode([t], [k])[0] for t, k in zip(TEXTS, MIXED)])
        assert cosine(b.encode(TEXTS, MIXED), ref).min() >= MIN_COSINE
        assert cosine(first, ref).min() >= MIN_COSINE
    finally:
        b.close()


def test_unknown_mix_is_refused(pool, tmp_path):
    with pytest.raises(InvalidInputError, match="mix"):
        SharedBackend(pool, tmp_path, mix="sideways")


def test_auto_gathers_only_batches_of_tiny_groups(pool, tmp_path, monkeypatch):
    from qswap.encoders.runtime.shared_run import gather_groups

    assert gather_groups(4, 4) and gather_groups(3, 2) and not gather_groups(4, 2) and not gather_groups(8, 1)
    b = _ready_backend(pool, tmp_path, mix="auto")
    try:
        tiny = ["l1@1", "l2@1", "b1@1", BASE_KEY]          # one row per encoder: gathered
        b.encode(TEXTS[:4], tiny)
        assert b.gathered_ready(wait=120)
        spy = _Spy(b, monkeypatch)
        got = b.encode(TEXTS[:4], tiny)
        assert sum(spy.gathered) == 4 and spy.groups == 0
        spy.gathered.clear()
        b.encode(TEXTS[:4], ["l1@1", "l1@1", "l2@1", "l2@1"])   # two rows per encoder: per group
        assert not spy.gathered and spy.groups >= 2
        ref = np.stack([pool.encode([t], [k])[0] for t, k in zip(TEXTS[:4], tiny)])
        assert cosine(got, ref).min() >= MIN_COSINE
    finally:
        b.close()


def test_the_bulk_lane_never_runs_gathered(gathered, pool, monkeypatch):
    assert gathered.gathered_ready(wait=120)
    spy = _Spy(gathered, monkeypatch)
    got, _ = gathered.encode_flagged_bulk(TEXTS, MIXED)   # one core, per group, in this thread
    assert not spy.gathered and spy.groups >= 4
    alone = np.stack([pool.encode([t], [k])[0] for t, k in zip(TEXTS, MIXED)])
    assert cosine(got, alone).min() >= MIN_COSINE

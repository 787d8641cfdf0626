"""The cuda backend's CPU twin: the gathered-adapter forward, its buckets and its adapter table run
eagerly here (the same code a GPU captures as CUDA graphs) and must give the torch pool's answers
for batches mixing up to 20 encoders of every kind and several LoRA ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qswap.encoders import BASE_KEY, EncoderPool, load_encoder
from qswap.encoders.runtime.adapter_table import AdapterTable
from qswap.encoders.runtime.backend import BACKENDS, TorchBackend, make_backend
from qswap.encoders.runtime.buckets import BATCH_BUCKETS, BucketRunner, bucket_of, length_buckets, rank_buckets
from qswap.encoders.runtime.cuda import CudaBackend
from qswap.encoders.runtime.gathered import GatheredForward
from qswap.errors import InvalidInputError, NotFoundError

from .adapters import make_lora, make_overrides

MIN_COSINE = 0.99999
TEXTS = ["chess puzzle game", "audio and music", "physics data", "the linux search server", "a tool for python",
         "math and science library with many games and music tools for debian", "video games", "network client",
         "a", "query document encoder for the index of the data server"]
# 16 LoRA encoders: ranks 2..16, four target sets (every Linear, attention only, feed-forward only, one layer type).
TARGETS = (("query", "key", "value", "dense"), ("query", "value"), ("intermediate.dense", "output.dense"), ("key",))
LORAS = [(f"l{i}", (2, 4, 8, 16)[i % 4], TARGETS[(i // 4) % 4]) for i in range(16)]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def encoder_dirs(tiny_base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cuda-enc")
    dirs = [make_lora(tiny_base, tmp / n, n, seed=i, r=r, targets=t) for i, (n, r, t) in enumerate(LORAS)]
    dirs += [make_overrides(tiny_base, tmp / f"b{i}", f"b{i}", "bias", seed=100 + i) for i in range(2)]
    dirs += [make_overrides(tiny_base, tmp / "p0", "p0", "partial", seed=200)]
    return dirs


@pytest.fixture(scope="module")
def pool(tiny_base, encoder_dirs):
    p = EncoderPool(tiny_base)
    for d in encoder_dirs:
        p.add(load_encoder(d, tiny_base.space))
    return p


@pytest.fixture(scope="module")
def all_keys(pool):
    keys = [k for k in pool.keys() if k != BASE_KEY] + [BASE_KEY]
    assert len(keys) == 20   # 16 LoRA, 2 bias, 1 partial, the base
    return keys


def _batch(keys: list[str], rows: int) -> tuple[list[str], list[str]]:
    texts = [TEXTS[i % len(TEXTS)] + (" game" * (i % 3)) for i in range(rows)]
    return texts, [keys[i % len(keys)] for i in range(rows)]


@pytest.mark.parametrize("n_encoders", [1, 4, 20])
def test_mixed_batches_match_the_torch_backend(pool, all_keys, n_encoders):
    backend = CudaBackend(pool, capacity=32, max_rank=16)
    # 1: one LoRA; 4: two LoRA ranks, a bias and the partial encoder; 20: every kind and rank.
    keys = {1: ["l3@1"], 4: ["l0@1", "l7@1", "b0@1", "p0@1"], 20: all_keys}[n_encoders]
    texts, row_keys = _batch(keys, max(2 * n_encoders, 9))
    got = backend.encode(texts, row_keys)
    ref = TorchBackend(pool).encode(texts, row_keys)
    assert cosine(got, ref).min() >= MIN_COSINE
    # Every row ran from the table except the partial encoder's (it replaces weight matrices).
    assert backend.runtime("p0@1") == "torch"
    assert {backend.runtime(k) for k in keys if k != "p0@1"} == {"gathered"}


def test_a_batch_of_twenty_encoders_is_one_bucket_run(pool, all_keys):
    backend = CudaBackend(pool, capacity=32, max_rank=16)
    texts, row_keys = _batch(all_keys, 40)
    backend.encode(texts, row_keys)
    # 38 rows on the table (2 of the partial encoder on the pool): one run of one bucket.
    assert backend.runner.replays == 1
    assert [(b[0], b[2]) for b in backend.runner.buckets()] == [(64, 16)]


def test_buckets_pad_rows_tokens_and_ranks(tiny_base):
    assert rank_buckets(64) == (0, 8, 16, 32, 64) and rank_buckets(12) == (0, 8, 12)
    assert length_buckets(64) == (16, 32, 64) and length_buckets(100) == (16, 32, 64, 100)
    assert [bucket_of(n, BATCH_BUCKETS) for n in (1, 3, 5, 33, 64)] == [1, 4, 8, 64, 64]
    with pytest.raises(ValueError):
        bucket_of(65, BATCH_BUCKETS)
    runner = BucketRunner(lambda *a: None, torch.device("cpu"), 0, 64, 16)
    assert runner.shape(3, 17, 4) == (4, 32, 8)
    assert runner.shape(1, 1, 0) == (1, 16, 0)
    assert runner.shape(64, 64, 16) == (64, 64, 16)


def test_padding_rows_and_tokens_change_no_answer(pool):
    backend = CudaBackend(pool, capacity=8, max_rank=16)
    texts, keys = TEXTS[:3], ["l1@1", "b0@1", BASE_KEY]
    together = backend.encode(texts, keys)             # 3 rows in a bucket of 4
    alone = np.vstack([backend.encode([t], [k]) for t, k in zip(texts, keys)])   # buckets of 1
    assert cosine(together, alone).min() >= MIN_COSINE
    assert {b[0] for b in backend.runner.buckets()} == {1, 4}


def test_large_batches_are_cut_into_buckets_in_input_order(pool):
    backend = CudaBackend(pool, capacity=8, max_rank=16)
    texts, keys = _batch(["l2@1", "l5@1", BASE_KEY], 150)
    got = backend.encode(texts, keys)
    assert backend.runner.replays == 3   # 64 + 64 + 22 rows
    assert cosine(got, TorchBackend(pool).encode(texts, keys)).min() >= MIN_COSINE


def test_slots_are_reused_least_recently_used_first(pool):
    backend = CudaBackend(pool, capacity=3, max_rank=16)   # the base + 2 encoders
    table = backend.table
    ptrs = [t.data_ptr() for t in table.a.values()]
    ref = TorchBackend(pool)
    for keys in (["l0@1", "l1@1"], ["l2@1"], ["l0@1"], ["b1@1", "l2@1"]):
        texts, row_keys = _batch(keys, 4)
        assert cosine(backend.encode(texts, row_keys), ref.encode(texts, row_keys)).min() >= MIN_COSINE
    # l2 evicted l0 (least recently used), l0 came back in l1's place, then b1 evicted l0, not
    # l2: l2 is in b1's batch (pinned), and then l2 became the most recently used.
    assert table.keys() == ["b1@1", "l2@1"]
    assert table.evictions == 3 and table.writes == 1 + 5   # the base's slot, then five writes
    assert [t.data_ptr() for t in table.a.values()] == ptrs   # written in place, never reallocated
    # A batch with more encoders than slots: the rows beyond the table run on the pool.
    texts, row_keys = _batch(["l3@1", "l4@1", "l5@1"], 6)
    assert cosine(backend.encode(texts, row_keys), ref.encode(texts, row_keys)).min() >= MIN_COSINE


def test_registering_writes_a_slot_without_recapturing(tiny_base, encoder_dirs, tmp_path):
    pool = EncoderPool(tiny_base)
    pool.add(load_encoder(encoder_dirs[1], tiny_base.space))   # l1, rank 4
    backend = CudaBackend(pool, capacity=8, max_rank=16)
    texts = TEXTS[:4]
    backend.encode(texts, ["l1@1", BASE_KEY] * 2)
    captures = backend.runner.captures
    writes = backend.table.writes
    new = make_lora(tiny_base, tmp_path / "late", "late", seed=77, r=8, targets=("query", "value", "dense"))
    pool.add(load_encoder(new, tiny_base.space))
    backend.prepare("late@1")
    assert backend.table.writes == writes + 1 and backend.table.slot("late@1") is not None
    keys = ["late@1", "l1@1"] * 2
    got = backend.encode(texts, keys)
    assert backend.runner.captures == captures   # same bucket (rank 8 pads like rank 4): no new capture
    assert cosine(got, TorchBackend(pool).encode(texts, keys)).min() >= MIN_COSINE
    backend.discard("late@1")
    pool.remove("late@1")
    assert backend.table.slot("late@1") is None


def test_forward_needs_no_host_synchronisation(tiny_base, pool):
    """On the meta device every tensor has a shape and no data: a forward that read a value on
    the host (``.item()``, a branch on a tensor, a data-dependent shape) fails here, as it would
    fail during CUDA-graph capture."""
    table = AdapterTable(tiny_base.model, capacity=4, max_rank=16, device="meta")
    table.assign("l0@1", pool.attached("l0@1"))
    fwd = GatheredForward(tiny_base.model, tiny_base.spec, table)
    ids = torch.zeros((4, 16), dtype=torch.long, device="meta")
    out = fwd(ids, torch.ones_like(ids), torch.zeros(4, dtype=torch.long, device="meta"), 16)
    assert out.shape == (4, tiny_base.dim) and out.dtype == torch.float32


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_keeps_the_direction(pool, precision):
    texts, keys = _batch(["l0@1", "b0@1", BASE_KEY], 6)
    half = CudaBackend(pool, precision=precision, capacity=8, max_rank=16).encode(texts, keys)
    assert cosine(half, TorchBackend(pool).encode(texts, keys)).min() > 0.99   # a random tiny model: loose


def test_backend_choice_and_refusals(pool, tmp_path):
    assert "cuda" in BACKENDS
    b = make_backend("cuda", pool, tmp_path, precision="fp16")
    assert isinstance(b, CudaBackend) and b.precision == "fp16" and not b.runner.graphs
    with pytest.raises(InvalidInputError, match="unknown precision"):
        CudaBackend(pool, precision="int8")
    with pytest.raises(InvalidInputError, match="2 slots"):
        CudaBackend(pool, capacity=1)
    with pytest.raises(NotFoundError):
        b.encode(["x"], ["nope@1"])
    with pytest.raises(InvalidInputError):
        b.encode(["x"], [])
    assert b.encode([], []).shape == (0, pool.base.dim)

"""Half-precision LoRA factors on the shared graph, which takes float32 ones on CPU: float32 copies
kept for the encoders served last (WideFeeds); answers equal to torch whichever copy a run takes over."""

from __future__ import annotations

import numpy as np
import pytest

from qswap.encoders import BASE_KEY, EncoderPool, load_encoder
from qswap.encoders.runtime.shared import SharedBackend

from .adapters import make_lora
from .test_shared import MIN_COSINE, TEXTS, cosine

SAME = ("w0@1", "w1@1", "w2@1")   # one rank and target set: each can take over another's copy


@pytest.fixture(scope="module")
def wide(tiny_base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wide")
    dirs = [make_lora(tiny_base, tmp / f"w{i}", f"w{i}", seed=10 + i, r=4, targets=("query", "value", "dense"))
            for i in range(3)]
    dirs.append(make_lora(tiny_base, tmp / "w3", "w3", seed=20, r=8, targets=("key",)))
    ref, half = EncoderPool(tiny_base), EncoderPool(tiny_base, factor_dtype="float16")
    for d in dirs:
        ref.add(load_encoder(d, tiny_base.space))
        half.add(load_encoder(d, tiny_base.space))
    one = sum(t.numel() * 4 for t in half.runtime_tensors(SAME[0]).values())   # room for one copy
    b = SharedBackend(half, tmp / "cache", threads=1, mix="groups", wide_bytes=one)
    for k in (*SAME, "w3@1", BASE_KEY):
        b.prepare(k)
    assert b.wait(SAME[0], timeout=120), b.error(SAME[0])
    yield ref, b, one
    b.close()


def test_the_graph_takes_float32_factors(wide):
    _, b, _ = wide
    types = {i.type for i in b._session.get_inputs() if ".lora_" in i.name}
    assert types == {"tensor(float)"}


def test_a_rotation_wider_than_the_copies_matches_torch(wide):
    ref, b, one = wide
    held = b._wide._held
    for k in (*SAME, "w3@1", *SAME, BASE_KEY, SAME[0]):
        before = [slot[0] for slot in held.values()]
        got = b.encode(TEXTS, [k] * len(TEXTS))
        assert cosine(got, ref.encode(TEXTS, [k] * len(TEXTS))).min() >= MIN_COSINE, k
        assert b.wide_bytes() <= one
        if k in SAME[1:] and before:   # same shapes: the held copy's feed (buffers, bindings) taken over
            assert [slot[0] for slot in held.values()] == before, k


def test_a_mixed_batch_matches_torch_per_row(wide):
    ref, b, _ = wide
    keys = [SAME[i % 3] if i % 4 else "w3@1" for i in range(len(TEXTS))]
    keys[-1] = BASE_KEY
    got = b.encode(TEXTS, keys)
    alone = np.stack([ref.encode([t], [k])[0] for t, k in zip(TEXTS, keys)])
    assert cosine(got, alone).min() >= MIN_COSINE


def test_discarding_an_encoder_frees_its_copy(wide, tiny_base):
    _, b, one = wide
    b.encode(TEXTS[:1], [SAME[2]])
    assert b.wide_bytes() == one
    b.discard(SAME[2])
    assert b.wide_bytes() == 0


def test_a_copy_is_one_mapping_of_its_own(wide):
    """The float32 copies of one encoder's factors are views of one page-rounded block (packed.py):
    a copy dropped from the cache is unmapped whole, not left as holes in a thread's heap."""
    import mmap

    _, b, one = wide
    b.encode(TEXTS[:1], [SAME[0]])
    copies = [t for slot in b._wide._held.values() for t in slot[1].values() if t.dtype.is_floating_point]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in copies}
    assert len(storages) == len(b._wide._held) == 1
    (size,) = storages.values()
    assert size % mmap.PAGESIZE == 0 and one <= size < one + mmap.PAGESIZE + 64 * len(copies)

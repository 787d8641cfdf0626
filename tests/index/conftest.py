"""Fixtures for qswap.index tests: a fake embedding space, a deterministic embed function
and small JSONL corpora. No model is loaded here."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import faiss
import numpy as np
import pytest

from qswap.space import EmbeddingSpace

DIM = 32
SECTIONS = ("games", "news", "tech")

# The test machine is shared: one OpenMP thread keeps FAISS polite and deterministic.
faiss.omp_set_num_threads(1)


def text_vector(text: str, dim: int = DIM) -> np.ndarray:
    """A unit vector determined by the text (same text, same vector)."""
    seed = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(dim)
    return (v / np.linalg.norm(v)).astype(np.float32)


def hash_embed(texts: list[str]) -> np.ndarray:
    return np.stack([text_vector(t) for t in texts]) if texts else np.zeros((0, DIM), np.float32)


def make_space(dim: int = DIM, weights: str = "a") -> EmbeddingSpace:
    return EmbeddingSpace(name="fake-model", weights_sha256=weights * 64, tokenizer_sha256="b" * 64,
                          pooling="mean", query_prefix="query: ", document_prefix="passage: ",
                          normalize=True, dim=dim)


def doc_record(i: int) -> dict:
    return {"id": f"d{i}", "text": f"document number {i} " + "word " * (i % 13),
            "section": SECTIONS[i % 3], "year": 2000 + i % 5, "hot": i % 2 == 0}


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode())
    return path


@pytest.fixture
def space() -> EmbeddingSpace:
    return make_space()


@pytest.fixture
def embed() -> Callable[[list[str]], np.ndarray]:
    return hash_embed


@pytest.fixture
def vec() -> Callable[[str], np.ndarray]:
    return text_vector


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A JSONL corpus of 150 documents with section/year/hot metadata."""
    return write_jsonl(tmp_path / "corpus.jsonl", [doc_record(i) for i in range(150)])


@pytest.fixture
def records() -> Callable[[int], list[dict]]:
    return lambda n: [doc_record(i) for i in range(n)]


@pytest.fixture
def jsonl() -> Callable[[Path, list], Path]:
    return write_jsonl


@pytest.fixture
def other_space() -> Callable[..., EmbeddingSpace]:
    return make_space

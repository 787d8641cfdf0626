"""Fixtures for tuning tests: small learnable data sets in the tiny model's vocabulary.

The task is built so that the untuned random model fails it: each query's positive uses a
fixed permutation of the query's words, its negative repeats the query's own words (lexical
overlap is the trap). Tuning can learn the mapping; a sentinel set built the other way round
(lexical positive, permuted negative) gets worse when it does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

WORDS = ("game games play music sound science math data network server client library tool python "
         "linux debian search index query document encoder chess puzzle physics chemistry audio video "
         "text").split()


def _perm(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(len(WORDS))


def write_triplets(path: Path, n: int, seed: int = 0, reverse: bool = False) -> Path:
    """``n`` lines of the permutation task (``reverse``: the lexical sentinel)."""
    rng = np.random.default_rng(seed + 100)
    perm = _perm(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.choice(len(WORDS), 2, replace=False)
            mapped = f"{WORDS[perm[a]]} {WORDS[perm[b]]} the"
            lexical = f"{WORDS[a]} {WORDS[b]} the"
            pos, neg = (lexical, mapped) if reverse else (mapped, lexical)
            f.write(json.dumps({"query": f"{WORDS[a]} {WORDS[b]}", "pos": [pos], "neg": [neg]}) + "\n")
    return path


def write_beir(folder: Path, n: int, langs: tuple[str, ...] = ("en", "de")) -> Path:
    """A per-language BEIR directory (Debian layout): one corpus, queries-<lang>, qrels/test-<lang>."""
    rng = np.random.default_rng(7)
    perm, other = _perm(0), _perm(3)
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    corpus, queries = [], {lang: [] for lang in langs}
    for i in range(n):
        a, b, c = rng.choice(len(WORDS), 3, replace=False)
        corpus.append({"_id": f"d{i}", "title": "", "text": f"{WORDS[perm[a]]} {WORDS[perm[b]]} {WORDS[c]}"})
        for j, lang in enumerate(langs):
            wa, wb = (WORDS[a], WORDS[b]) if j == 0 else (WORDS[other[a]], WORDS[other[b]])
            queries[lang].append({"_id": f"q{i}", "text": f"{wa} {wb}"})
    (folder / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus))
    for lang in langs:
        (folder / f"queries-{lang}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in queries[lang]))
        (folder / "qrels" / f"test-{lang}.tsv").write_text(
            "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(n)))
    return folder


@pytest.fixture(scope="session")
def tuning_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tuning-data")
    return {"train": write_triplets(d / "train.jsonl", 120),
            "sentinel_same": write_triplets(d / "same.jsonl", 40, seed=1),
            "sentinel_lexical": write_triplets(d / "lexical.jsonl", 40, seed=2, reverse=True),
            "beir": write_beir(d / "beir", 150)}

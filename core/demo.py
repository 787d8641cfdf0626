"""The tour's example files, made from the bundled demo corpus (:mod:`qswap.data`'s 400 Debian
package descriptions): what the README's and getting-started's commands read.

- ``corpus.jsonl``: the documents (``{"id", "text", "section", "title"}``), as ``qswap index build`` reads them;
- ``triplets.jsonl``: training triplets ``{"query", "pos": [text], "neg": [text]}`` for ``qswap tune run``:
  the query is a package's one-line title, the positive its description, the negative the description
  of a package from another section;
- ``support-queries.jsonl``: labelled queries ``{"query", "relevant": [id]}`` for ``qswap sentinels make``,
  from other packages than the triplets' (a sentinel never tests on what an encoder trained on).

The titles are real users' words for a package only roughly; they make a small, honest task for
trying the commands, not a benchmark.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from qswap.atomic import atomic_write_bytes

#: The files :func:`write_tour_files` writes.
TOUR_FILES = ("corpus.jsonl", "triplets.jsonl", "support-queries.jsonl")
# One document in this many goes to the labelled queries, the rest to the training triplets.
_HELD_OUT_EVERY = 4


def demo_corpus() -> Path:
    """The bundled demo corpus file (JSONL lines: id, text, title, section)."""
    return Path(str(resources.files("qswap") / "data" / "demo_corpus.jsonl"))


def demo_documents() -> list[dict]:
    """The bundled demo corpus: 400 documents, 25 from each of 16 Debian sections."""
    text = demo_corpus().read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def write_tour_files(out: Path, n_docs: int | None = None) -> dict[str, int]:
    """Write the tour's three files into ``out``.

    Args:
        out: the folder (created if missing); existing files of the same names are replaced atomically.
        n_docs: use the first ``n_docs`` documents (default: all 400).

    Returns:
        Lines written per file.
    """
    docs = demo_documents()[:n_docs]
    out.mkdir(parents=True, exist_ok=True)
    train = [d for i, d in enumerate(docs) if i % _HELD_OUT_EVERY]
    held = [d for i, d in enumerate(docs) if not i % _HELD_OUT_EVERY]
    triplets = []
    for i, d in enumerate(train):
        # the nearest following document of another section is the negative (deterministic)
        neg = next((o for o in train[i + 1:] + train[:i] if o["section"] != d["section"]), None)
        if neg is not None:
            triplets.append({"query": d["title"], "pos": [d["text"]], "neg": [neg["text"]]})
    labelled = [{"query": d["title"], "relevant": [d["id"]]} for d in held]
    lines = {"corpus.jsonl": docs, "triplets.jsonl": triplets, "support-queries.jsonl": labelled}
    for name, rows in lines.items():
        atomic_write_bytes(out / name, "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in rows).encode())
    return {name: len(rows) for name, rows in lines.items()}


__all__ = ["TOUR_FILES", "demo_corpus", "demo_documents", "write_tour_files"]

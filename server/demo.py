"""The demo index: the bundled demo corpus embedded by the served base model, built on first start.

It lives in ``qswap.paths.data_dir() / "demo" / "index"`` and is reused while its embedding
space and the corpus checksum still match; otherwise it is rebuilt (atomically, by
:func:`qswap.index.build_index`).
"""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path

from qswap.atomic import sha256_file
from qswap.encoders import BaseModel
from qswap.errors import QswapError
from qswap.index import DocumentIndex, IndexConfig, build_index
from qswap.paths import data_dir

log = logging.getLogger("qswap.server")


def demo_corpus() -> Path:
    """The bundled demo corpus (JSONL lines: id, text, title, section)."""
    return Path(str(resources.files("qswap") / "data" / "demo_corpus.jsonl"))


def demo_index_dir() -> Path:
    return data_dir() / "demo" / "index"


def open_demo_index(base: BaseModel, out: Path | None = None) -> DocumentIndex:
    """Open the cached demo index, or build it from the bundled corpus with ``base``."""
    out = Path(out) if out is not None else demo_index_dir()
    corpus = demo_corpus()
    sha = sha256_file(corpus)
    if out.exists():
        try:
            idx = DocumentIndex.open(out, expected_space=base.space)
            if idx.info().get("build", {}).get("corpus_sha256") == sha:
                return idx
            idx.close()
            log.info("demo corpus changed; rebuilding the demo index", extra={"path": str(out)})
        except QswapError as e:
            log.info("rebuilding the demo index", extra={"path": str(out), "reason": e.message})
    log.info("building the demo index (first start)", extra={"path": str(out), "model": base.name})
    out.parent.mkdir(parents=True, exist_ok=True)
    return build_index(corpus, out, lambda texts: base.encode_documents(texts), base.space,
                       IndexConfig(), progress=True, model=base.name)

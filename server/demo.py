"""The demo index: the bundled demo corpus embedded by the served base model, built on first start.

It lives in ``qswap.paths.data_dir() / "demo" / "index"`` and is reused while its embedding
space and the corpus checksum still match; otherwise it is rebuilt (atomically, by
:func:`qswap.index.build_index`). An index another process holds for writing (a second server
started on the same data dir) is never rebuilt or written: it is served read-only when it fits,
otherwise the start is refused naming the holder.
"""

from __future__ import annotations

import logging
from pathlib import Path

from qswap.atomic import sha256_file
from qswap.encoders import BaseEncoder
from qswap.encoders.runtime.documents import DocumentEncoder
from qswap.errors import ConflictError, QswapError, SpaceMismatchError
from qswap.index import DocumentIndex, IndexConfig, build_index
from qswap.index.backends.faiss.recovery import lock_holder
from qswap.demo import demo_corpus
from qswap.paths import data_dir

log = logging.getLogger("qswap.server")


def demo_index_dir() -> Path:
    return data_dir() / "demo" / "index"


def open_demo_index(base: BaseEncoder, out: Path | None = None) -> DocumentIndex:
    """Open the cached demo index, or build it from the bundled corpus with ``base``."""
    out = Path(out) if out is not None else demo_index_dir()
    corpus = demo_corpus()
    sha = sha256_file(corpus)
    if out.exists():
        try:
            idx = DocumentIndex.open(out, expected_space=base.space)
        except SpaceMismatchError as e:
            idx = None
            log.info("rebuilding the demo index", extra={"path": str(out), "reason": e.message})
        except ConflictError:
            # Another process (a second server on this data dir) holds the index: never rebuild
            # or write it; serve it read-only when it is this model's demo, else refuse.
            return _open_held(out, base, sha)
        except QswapError as e:
            idx = None
            log.info("rebuilding the demo index", extra={"path": str(out), "reason": e.message})
        if idx is not None:
            if idx.info().get("build", {}).get("corpus_sha256") == sha:
                return idx
            idx.close()
            log.info("demo corpus changed; rebuilding the demo index", extra={"path": str(out)})
    log.info("building the demo index (first start)", extra={"path": str(out), "model": base.name})
    out.parent.mkdir(parents=True, exist_ok=True)
    docs = DocumentEncoder(base)
    return build_index(corpus, out, docs, base.space, IndexConfig(), progress=True, model=base.name,
                       embedding=docs.record)


def _open_held(out: Path, base: BaseEncoder, sha: str) -> DocumentIndex:
    """The demo index another process holds for writing, opened read-only if it is usable as is."""
    holder = lock_holder(out)
    hint = ("stop the other server, or give this one its own data dir (QSWAP_DATA_DIR) or an index "
            "(--index)")
    try:
        idx = DocumentIndex.open(out, read_only=True, expected_space=base.space)
    except QswapError as e:
        raise ConflictError(f"the demo index {out} is held by {holder} and cannot serve this server "
                            f"({e.message})", hint) from None
    if idx.info().get("build", {}).get("corpus_sha256") != sha:
        idx.close()
        raise ConflictError(f"the demo index {out} is held by {holder} and was built from another demo corpus",
                            hint)
    log.warning("the demo index is held by another process; serving it read-only (document changes refused)",
                extra={"path": str(out), "holder": holder})
    return idx

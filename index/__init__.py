"""qswap.index: the document side of qswap.

The frozen text tower embeds a corpus once; the index serves every query encoder of the
same embedding space. An index folder holds FAISS (Matryoshka prefix, scalar/product
quantisation, flat/HNSW/IVF), the full-precision float16 embeddings (for exact rescoring,
re-indexing and tuning) and a SQLite document store, all committed atomically under one
manifest.

    from qswap.index import DocumentIndex, Document, IndexConfig, build_index
    idx = DocumentIndex.open(path)
    hits = idx.search(query_embeddings, k=10, filter={"section": "games"})

Backends (:mod:`qswap.index.backends`): the FAISS folder above (default) or a Milvus
collection, both behind :class:`IndexBackend`; ``open_index(location)`` opens either.

This package never imports qswap.encoders (only ``qswap.index.cli`` does, lazily):
building takes an ``embed(texts) -> array`` function and the :class:`EmbeddingSpace`.
"""

from qswap.index.build import build_index, create_index
from qswap.index.config import IndexConfig
from qswap.index.corpus import BadLine, Document
from qswap.index.evaluate import evaluate, synthetic_embeddings
from qswap.index.backends import IndexBackend, open_index
from qswap.index.backends.faiss.index import DocumentIndex
from qswap.index.hit import Hit

__all__ = ["BadLine", "Document", "DocumentIndex", "Hit", "IndexBackend", "IndexConfig", "build_index", "create_index",
           "evaluate", "open_index", "synthetic_embeddings"]

"""Client tests run against the same real servers as the server tests (uvicorn, real index)."""

from ..server.conftest import (corpus_docs, doc_embeddings, encoders_root, index_dir, live,  # noqa: F401
                               reference_pool)

"""Server upserts embed through the document tower, at the precision of the index's documents."""

from __future__ import annotations

import json

import numpy as np

from .conftest import ADMIN, LiveServer, server_settings


def test_upserts_use_the_document_tower_at_the_index_precision(tmp_path, tiny_base, tiny_model_dir, corpus_docs):
    from qswap.encoders.runtime.documents import DocumentEncoder
    from qswap.index import DocumentIndex, build_index

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in corpus_docs))
    bf16 = DocumentEncoder(tiny_base, precision="bf16")
    build_index(corpus, tmp_path / "idx", bf16, tiny_base.space, progress=False, embedding=bf16.record).close()
    docs = [{"id": "new-1", "text": "chess puzzle physics"}, {"id": "new-2", "text": "audio video music"}]
    with LiveServer(server_settings(tmp_path, tiny_model_dir, tmp_path / "idx", admin_token=ADMIN)) as srv:
        with srv.client(ADMIN) as c:
            r = c.post("/v1/documents", json={"documents": docs})
        assert r.status_code == 200 and r.json()["upserted"] == 2
        enc = srv.app.state.qs.document_encoder()
        assert isinstance(enc, DocumentEncoder) and enc.precision == "bf16" and enc.docs_embedded == 2
    with DocumentIndex.open(tmp_path / "idx", read_only=True) as idx:
        ids, vecs = idx.export_embeddings()
    got = vecs[[ids.index("new-1"), ids.index("new-2")]].astype(np.float32)
    want = DocumentEncoder(tiny_base, precision="bf16").encode([d["text"] for d in docs])
    assert np.abs(got - want).max() < 2e-3   # float16 storage

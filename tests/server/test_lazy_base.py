"""A server restarted on its cached exports serves without building the torch base model, and
builds it (once) when a path that needs torch comes: here, attaching a LoRA encoder."""

from __future__ import annotations

from .conftest import ADMIN, LiveServer, server_settings
from .exact import assert_served_by

QUERY = "chess puzzle game"


def test_restart_on_cached_exports_serves_without_the_torch_model(tmp_path, tiny_model_dir, index_dir, encoders_root,
                                                                 reference_pool, doc_embeddings, corpus_docs):
    ids = [d["id"] for d in corpus_docs]
    s = server_settings(tmp_path, tiny_model_dir, index_dir, encoders_root=encoders_root, admin_token=ADMIN,
                        read_only_index=True)
    with LiveServer(s) as srv:   # first start: nothing cached, the model is built and the graph exported
        qs = srv.app.state.qs
        assert qs.base.built and qs.backend.wait(timeout=300)
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        qs = srv.app.state.qs
        assert qs.backend.wait(timeout=120)
        assert c.get("/v1/encoders/base").json()["runtime"] == "onnx-shared"
        r = c.post("/v1/search", json={"query": QUERY, "k": 5})
        assert r.status_code == 200, r.text
        assert_served_by(r.json()["results"][0]["hits"], reference_pool, doc_embeddings, ids, "base", QUERY, 5)
        r = c.post("/v1/embeddings", json={"input": [QUERY], "model": "base"})
        assert r.status_code == 200, r.text
        assert not qs.base.built
        # Attaching a LoRA encoder runs torch (its checks and probe queries): the model is built now.
        assert c.post("/v1/encoders", json={"path": "ft1"}).status_code == 201
        assert qs.base.built
        for key in ("ft@1", "base"):
            r = c.post("/v1/search", json={"query": QUERY, "k": 5, "encoder": key})
            assert r.status_code == 200, r.text
            assert_served_by(r.json()["results"][0]["hits"], reference_pool, doc_embeddings, ids, key, QUERY, 5)

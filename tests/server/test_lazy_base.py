"""A server restarted on its cached exports serves without building the torch base model, and
builds it (once) when a path that needs torch comes: here, attaching a LoRA encoder."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_a_warm_start_imports_no_transformers(tmp_path, tiny_model_dir, index_dir, encoders_root):
    """A fresh server process on a warm state dir (logging set up as `qswap serve` does, the app
    built and loaded) never imports ``transformers``: neither the logging set-up nor the base needs it."""
    s = server_settings(tmp_path, tiny_model_dir, index_dir, encoders_root=encoders_root, admin_token=ADMIN,
                        read_only_index=True)
    with LiveServer(s) as srv:   # first start: the layout recorded, the graph exported
        assert srv.app.state.qs.backend.wait(timeout=300)
    given = {"model": str(tiny_model_dir), "index": str(index_dir), "device": "cpu", "state_dir": str(s.state_dir),
             "encoders_root": str(encoders_root), "admin_token": ADMIN, "read_only_index": True}
    script = f"""
import json, logging, sys
from qswap.server.config import ServerSettings
from qswap.server.http.app import create_app
from qswap.server.http.logs import configure_logging
configure_logging(json_lines=True)
app = create_app(ServerSettings(**json.loads({json.dumps(given)!r})))
qs = app.state.qs
try:
    qs.load()
    out = {{"ready": qs.ready, "built": qs.base.built,
           "transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers")}}
finally:
    qs.close()
print(json.dumps(out))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res == {"ready": True, "built": False, "transformers": []}, out.stderr[-3000:]

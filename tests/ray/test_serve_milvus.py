"""qswap serve --ray over a collection of a real Milvus server (the session's LocalMilvus): two
ingress replicas, each with its own connection to Milvus (no writer actor: Milvus is the one
writer); a write through one replica is searchable through both."""

from __future__ import annotations

import time
from typing import Iterator

import httpx
import pytest

from ..server.conftest import ADMIN
from .conftest import ray_settings, replica_stats, wait_ready

COLLECTION = "ray_serve_milvus"


@pytest.fixture(scope="module")
def milvus_ray_url(ray_cluster, serve_port, milvus_server, tmp_path_factory, tiny_model_dir, tiny_base,
                   ray_corpus) -> Iterator[tuple[str, object]]:
    from ray import serve

    from qswap.index.backends.milvus.build import build_collection
    from qswap.server.ray.serve import RayOptions, deploy
    build_collection(ray_corpus, milvus_server.http_uri, COLLECTION, tiny_base.encode_documents, tiny_base.space,
                     progress=False, replace=True).close()
    tmp = tmp_path_factory.mktemp("raymilvus")
    s = ray_settings(tmp, tiny_model_dir, f"{milvus_server.uri}?collection={COLLECTION}", port=serve_port)
    # Two ingress replicas, each with its own Milvus connection (the point here); the encoder
    # deployment behind them is the default layout's, and one replica of it is enough.
    url = deploy(s, RayOptions(replicas=2, encoder_replicas=1, max_encoders=2, replica_cpus=0.5))
    try:
        wait_ready(url, 2)
        yield url, s.state_dir
    finally:
        serve.delete("qswap")


def test_a_write_through_one_replica_is_searchable_through_both(milvus_ray_url):
    url, state_dir = milvus_ray_url
    stats = replica_stats(state_dir)
    assert len(stats) == 2 and all(s["index_generation"] is None for s in stats.values())  # no folder generations
    with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        assert c.get("/readyz").json()["index_documents"] == 60
        doc = {"id": "milvus-new", "text": "puzzle chess", "metadata": {"uid": "ray-milvus"}}
        r = c.post("/v1/documents", json={"documents": [doc]})
        assert r.status_code == 200, r.text
        # Each replica holds its own Milvus connection; one that did not write sees the write
        # within the server's time tick (Session consistency). Done: 20 answers in a row have it,
        # and both replicas answered some of those 20.
        body = {"query": "puzzle chess", "k": 3, "filter": {"uid": "ray-milvus"}}
        streak, before, t0 = 0, {}, time.monotonic()
        while True:
            r = c.post("/v1/search", json=body)
            assert r.status_code == 200, r.text
            if [h["id"] for h in r.json()["results"][0]["hits"]] != ["milvus-new"]:
                streak = 0
            else:
                if streak == 0:
                    before = {k: v["admitted"] for k, v in replica_stats(state_dir).items()}
                streak += 1
                if streak >= 20:
                    after = {k: v["admitted"] for k, v in replica_stats(state_dir).items()}
                    if len(after) == 2 and all(after[k] > before.get(k, 0) for k in after):
                        break
                    streak = 0
            assert time.monotonic() - t0 < 20, "the write was not searchable through both replicas"
        r = c.request("DELETE", "/v1/documents", json={"ids": ["milvus-new"]})
        assert r.status_code == 200 and r.json()["deleted"] == 1

"""qswap serve --ray: two replicas on a local Ray cluster against the single-process server."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from ..server.conftest import ADMIN, LiveServer, server_settings
from .conftest import ray_settings, replica_stats, wait_ready

QUERIES = ["chess game", "linux server network", "music audio video", "physics chemistry science",
           "python library tool", "search index query"]


@pytest.fixture(scope="module")
def ray_url(ray_cluster, tmp_path_factory, tiny_model_dir, ray_index, ray_encoders) -> Iterator[str]:
    from ray import serve

    from qswap.server.ray_serve import deploy
    tmp = tmp_path_factory.mktemp("rayserve")
    s = ray_settings(tmp, tiny_model_dir, ray_index, encoders_root=ray_encoders)
    url = deploy(s, replicas=2, max_encoders=2, replica_cpus=0.5)
    wait_ready(url, 2)
    yield url
    serve.delete("qswap")


def admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {ADMIN}"})


def test_same_hits_as_single_process(ray_url, tmp_path, tiny_model_dir, ray_index, ray_encoders):
    # the single-process server over a copy-free read-only open of the same index
    s = server_settings(tmp_path, tiny_model_dir, ray_index, read_only_index=True, encoders_root=ray_encoders,
                        admin_token=ADMIN)
    with LiveServer(s) as single, admin(ray_url) as rc, single.client(ADMIN) as sc:
        for c in (rc, sc):
            r = c.post("/v1/encoders", json={"path": "e1"})
            assert r.status_code in (200, 201), r.text
        for enc in (None, "enc1@1"):
            for q in QUERIES:
                body = {"query": q, "k": 5, **({"encoder": enc} if enc else {})}
                a = rc.post("/v1/search", json=body)
                b = sc.post("/v1/search", json=body)
                assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
                ha = [(h["id"], round(h["score"], 5)) for h in a.json()["results"][0]["hits"]]
                hb = [(h["id"], round(h["score"], 5)) for h in b.json()["results"][0]["hits"]]
                assert ha == hb and len(ha) == 5
                assert a.json()["results"][0]["encoder"]["key"] == (enc or "base")

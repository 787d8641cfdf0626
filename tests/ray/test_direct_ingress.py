"""qswap serve --ray with Ray Serve's direct ingress (``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``).

In that mode Serve starts no proxy: each ingress replica listens on a port of its own
(``RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT``..., from 30000), and the controller publishes those
ports as target groups for a load balancer (HAProxy or the operator's own). Ray refuses
``@serve.multiplexed`` on an ingress deployment in this mode; qswap multiplexes on the encoder
deployment behind the ingress, so the app deploys and serves LoRA encoders.
"""

from __future__ import annotations

import time
from typing import Iterator

import httpx
import pytest

from ..server.conftest import ADMIN
from .conftest import local_cluster, ray_settings, wait_ready


@pytest.fixture(scope="module")
def direct_cluster(ray_clusters) -> Iterator[None]:
    """A local Ray cluster started with direct ingress on (its processes inherit the flag).

    Without a load balancer to deregister from, an ingress replica need not hold itself open
    for Ray's minimum draining period (30 s, for external load balancers) when Serve stops: a
    replica still drains its in-flight requests."""
    ray_clusters.use("direct", lambda: local_cluster(RAY_SERVE_ENABLE_DIRECT_INGRESS="1",
                                                     RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="0"))
    try:
        yield
    finally:
        ray_clusters.close()   # the flag must not outlive this module


@pytest.fixture(scope="module")
def serve_port(direct_cluster, ray_clusters) -> int:
    """Serve's HTTP port for every test here: Serve, started by the first deployment, stays up
    between tests (each deletes its app), so its controller starts once per module."""
    return ray_clusters.serve_port


def ingress_ports(app_name: str = "qswap", want: int = 1, timeout_s: float = 60.0) -> list[int]:
    """The ports of the ingress replicas, as the controller publishes them to load balancers."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    deadline = time.monotonic() + timeout_s
    while True:
        groups = ray.get(controller.get_target_groups.remote(app_name))
        ports = sorted({t.port for g in groups if str(g.protocol).endswith("HTTP") for t in g.targets})
        if len(ports) >= want:
            return ports
        assert time.monotonic() < deadline, f"no direct-ingress targets: {groups}"
        time.sleep(0.2)


def test_direct_ingress_serves_a_lora_encoder(direct_cluster, serve_port, tmp_path, tiny_model_dir, ray_index,
                                              ray_encoders):
    from ray import serve

    from qswap.server.ray.serve import RayOptions, deploy
    s = ray_settings(tmp_path, tiny_model_dir, ray_index, encoders_root=ray_encoders, port=serve_port)
    deploy(s, RayOptions(replicas=1, encoder_replicas=1, replica_cpus=0.5))
    try:
        ports = ingress_ports()
        # A replica's own port, not Serve's proxy port: the request reaches the ingress directly
        # (on the host of http_options, which the replicas bind).
        assert s.port not in ports, ports
        url = f"http://{s.host}:{ports[0]}"
        wait_ready(url, 1)
        with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
            r = c.post("/v1/encoders", json={"path": "e1"})
            assert r.status_code == 201, r.text
            r = c.post("/v1/search", json={"query": "chess game", "k": 3, "encoder": "enc1"})
            assert r.status_code == 200, r.text
            res = r.json()["results"][0]
            assert res["encoder"]["key"] == "enc1@1" and len(res["hits"]) == 3
            # the same errors as in one process
            r = c.post("/v1/search", json={"query": "chess", "encoder": "nope"})
            assert r.status_code == 404 and r.json()["error"] == "not_found"
        enc = serve.get_deployment_handle("QswapEncoder", app_name="qswap").replica_stats.remote().result(timeout_s=30)
        assert "enc1@1" in enc["resident"] and enc["loads"] == 1
    finally:
        serve.delete("qswap")


def test_encoders_in_the_ingress_answer_like_one_process(direct_cluster, serve_port, tmp_path, tiny_model_dir,
                                                         ray_index, ray_encoders):
    """``--encoder-replicas 0``: no encoder deployment, the ingress replica encodes itself (no hop);
    with direct ingress there is no proxy either. Same hits as the single-process server."""
    from ray import serve

    from qswap.server.ray.serve import RayOptions, deploy

    from ..server.conftest import LiveServer, server_settings
    s = ray_settings(tmp_path / "ray", tiny_model_dir, ray_index, encoders_root=ray_encoders, port=serve_port)
    deploy(s, RayOptions(replicas=1, encoder_replicas=0, replica_cpus=0.5))
    single = LiveServer(server_settings(tmp_path / "one", tiny_model_dir, ray_index, read_only_index=True,
                                        encoders_root=ray_encoders, admin_token=ADMIN))
    try:
        assert set(serve.status().applications["qswap"].deployments) == {"QswapIngress"}
        url = f"http://{s.host}:{ingress_ports()[0]}"
        wait_ready(url, 1)
        with single, httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {ADMIN}"}) as rc, \
                single.client(ADMIN) as sc:
            for c in (rc, sc):
                assert c.post("/v1/encoders", json={"path": "e1"}).status_code == 201
            for q in ("chess game", "linux server network"):
                a, b = (c.post("/v1/search", json={"query": q, "k": 5, "encoder": "enc1"}) for c in (rc, sc))
                assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
                ha, hb = a.json()["results"][0]["hits"], b.json()["results"][0]["hits"]
                assert [h["id"] for h in ha] == [h["id"] for h in hb] and len(ha) == 5
                assert max(abs(x["score"] - y["score"]) for x, y in zip(ha, hb)) < 1e-4
            r = rc.post("/v1/search", json={"query": "chess", "encoder": "nope"})
            assert r.status_code == 404 and r.json()["error"] == "not_found"
    finally:
        serve.delete("qswap")


def test_encoders_in_the_ingress_refuse_encoder_deployment_options():
    from qswap.errors import InvalidInputError
    from qswap.server.ray.serve import RayOptions
    for bad in ({"autoscaling": {"min_replicas": 1}}, {"encoder_gpus": 1.0}):
        with pytest.raises(InvalidInputError, match="--encoder-replicas 0"):
            RayOptions(replicas=1, encoder_replicas=0, **bad).check()

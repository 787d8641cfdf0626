"""A two-node Ray cluster on one machine (head and worker started with ``ray start``, 1 CPU each):
an index built with Ray Data across both nodes, and ``qswap serve --ray --address`` with
replicas on both nodes surviving the loss of the worker node under traffic."""

from __future__ import annotations

import functools
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ..handshake import Counter
from ..server.conftest import ADMIN
from .nodes import NODE_ENV, RayNode, alive_nodes, serve_replicas, wait_nodes
from .test_build import _compare

#: One request waits this long at most: a refusal while replicas move must be fast.
REQUEST_TIMEOUT_S = 20.0
#: A refusal (503) must come this fast: the client is told to retry, not kept waiting.
FAIL_FAST_S = 5.0


@dataclass
class Cluster:
    """The module's nodes: ``nodes[0]`` is the head; a restarted worker is appended."""

    root: Path
    nodes: list[RayNode] = field(default_factory=list)

    @property
    def head(self) -> RayNode:
        return self.nodes[0]

    def add_worker(self, name: str) -> RayNode:
        node = RayNode(self.root / name, 1, {"qswap_worker": 1}, head=self.head.address)
        self.nodes.append(node)
        return node.start()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    import ray
    c = Cluster(tmp_path_factory.mktemp("rn"))
    old = {k: os.environ.get(k) for k in NODE_ENV}
    os.environ.update(NODE_ENV)
    try:
        c.nodes.append(RayNode(c.root / "h", 1, {"qswap_head": 1}).start())
        c.add_worker("w")
        ray.init(address=c.head.address, logging_level="ERROR", log_to_driver=False)
        wait_nodes(2)
        yield c
    finally:
        try:
            ray.shutdown()
        finally:
            for node in reversed(c.nodes):
                node.stop()
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _embed_on_node(model_dir: str, seen: str) -> Any:
    """A Ray Data actor's embedder that records the node it runs on."""
    import ray

    from qswap.encoders.runtime.embedder import document_embedder
    Path(seen, f"{ray.get_runtime_context().get_node_id()}-{os.getpid()}").touch()
    return document_embedder(model_dir)


def test_index_build_runs_on_both_nodes_and_equals_local_build(cluster, tmp_path, tiny_base, tiny_model_dir,
                                                             ray_corpus):
    from qswap.index import IndexConfig, build_index
    from qswap.index.ray_build import build_index_on_ray
    cfg = IndexConfig(chunk_rows=16, batch_size=8)
    local = tmp_path / "local"
    build_index(ray_corpus, local, lambda t: tiny_base.encode_documents(t, batch_size=len(t)), tiny_base.space, cfg,
                progress=False, model=str(tiny_model_dir)).close()
    seen = tmp_path / "seen"
    seen.mkdir()
    # Two embedders of 1 CPU on two 1-CPU nodes: one on each.
    build_index_on_ray(ray_corpus, tmp_path / "ray", functools.partial(_embed_on_node, str(tiny_model_dir), str(seen)),
                       tiny_base.space, cfg, workers=2, cpus_per_worker=1, progress=False,
                       model=str(tiny_model_dir)).close()
    nodes = {p.name.split("-")[0] for p in seen.iterdir()}
    assert nodes == set(alive_nodes()), nodes
    _compare(local, tmp_path / "ray")

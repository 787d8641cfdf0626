"""A real local Ray cluster (one per test module) serving a real index with tiny models."""

from __future__ import annotations

import json
import os
import time
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from ..encoders.adapters import make_lora
from ..server.conftest import ADMIN, make_docs
from ..workers import last_users

pytest.importorskip("ray.serve", reason="qswap[ray] is not installed")

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# One auth mode for every Ray cluster of the session: a driver fixes its mode when it first uses
# Ray, while a cluster started later reads the variable; the two-node cluster (test_multinode)
# runs without a token (its nodes listen on this machine only), so all run without one.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@contextmanager
def local_cluster(**env: str) -> Iterator[None]:
    """A local Ray cluster (small, no dashboard) whose processes inherit ``env`` besides what
    `qswap serve --ray` sets for a cluster it starts (qswap.index.ray_build.init_ray)."""
    import ray
    from ray import serve
    os.environ.setdefault("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "0")
    os.environ.setdefault("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", "0")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    for attempt in (1, 2):
        try:
            ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            # Ray gives its raylet a fixed 30 s to register; on a loaded 2-core machine, right after
            # the previous module's cluster went down, that start can miss it. Start once more.
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            ray.shutdown()
    try:
        yield
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class Clusters:
    """The session's one Ray cluster at a time: modules that need a plain local cluster share one
    (a start and a stop cost ~10 s each on a 2-core machine); a module that needs another kind
    (direct ingress, two nodes) closes it first, and the next plain module starts it again.
    ``serve_port``: the HTTP port of Serve on the running cluster, the same for every module that
    deploys on it (Serve keeps the port it started with)."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.serve_port: int | None = None
        self._stack: ExitStack | None = None

    def use(self, kind: str, start: Callable[[], AbstractContextManager[Any]]) -> None:
        """Make ``kind`` the running cluster (``start()`` enters it), closing another kind first."""
        if self.kind == kind:
            return
        self.close()
        from qswap.bench.processes import free_port
        stack = ExitStack()
        stack.enter_context(start())
        self._stack, self.kind, self.serve_port = stack, kind, free_port()

    def close(self) -> None:
        """Stop the running cluster, if any."""
        stack, self._stack, self.kind, self.serve_port = self._stack, None, None, None
        if stack is not None:
            stack.close()


_CLUSTERS: list[Clusters] = []   # the session's (pytest_runtest_teardown closes its cluster)


@pytest.fixture(scope="session")
def ray_clusters() -> Iterator[Clusters]:
    clusters = Clusters()
    _CLUSTERS.append(clusters)
    try:
        yield clusters
    finally:
        clusters.close()
        _CLUSTERS.remove(clusters)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """Once the last Ray test and its module's fixtures are done, stop the cluster: its controller,
    proxy and agents would take ~0.1-0.2 CPU while idle beside the worker's other tests until the
    session ends. (A later test that asked for one would start it again: `Clusters.use`.)"""
    try:
        return (yield)
    finally:
        if any(c.kind for c in _CLUSTERS) and item.nodeid == last_users(item.session.items).get("ray"):
            for clusters in _CLUSTERS:
                clusters.close()


@pytest.fixture(scope="module")
def ray_cluster(ray_clusters: Clusters) -> Iterator[None]:
    """A plain local Ray cluster, shared by the modules that ask for one. Serve, once a module
    deployed, keeps running between modules on `serve_port` (its controller and proxy start once
    per cluster); the applications a module leaves are deleted after it."""
    ray_clusters.use("local", local_cluster)
    try:
        yield
    finally:
        delete_apps()


@pytest.fixture(scope="module")
def serve_port(ray_cluster, ray_clusters: Clusters) -> int:
    """The port a module deploys on, on the plain cluster (`ray_settings(..., port=serve_port)`)."""
    assert ray_clusters.serve_port is not None
    return ray_clusters.serve_port


def delete_apps() -> None:
    """Delete every Serve application on the cluster, if Serve runs; Serve itself stays."""
    from ray import serve
    for name in serve.status().applications:
        serve.delete(name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules on the shared plain cluster run one after another (after those that need another
    kind of cluster), so the plain one starts once."""
    own = ("test_direct_ingress.py", "test_multinode.py")
    here = [i for i, item in enumerate(items) if Path(str(item.path)).parent == Path(__file__).parent]
    ordered = sorted((items[i] for i in here), key=lambda item: Path(str(item.path)).name not in own)
    for i, item in zip(here, ordered):
        items[i] = item


@pytest.fixture(scope="module")
def ray_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("raycorpus")
    p = d / "corpus.jsonl"
    p.write_text("".join(json.dumps(doc) + "\n" for doc in make_docs(60, seed=3)))
    return p


@pytest.fixture(scope="module")
def ray_index(tmp_path_factory: pytest.TempPathFactory, tiny_base, ray_corpus) -> Path:
    from qswap.index import build_index
    out = tmp_path_factory.mktemp("rayidx") / "idx"
    build_index(ray_corpus, out, tiny_base.encode_documents, tiny_base.space, progress=False).close()
    return out


@pytest.fixture(scope="module")
def ray_encoders(tmp_path_factory: pytest.TempPathFactory, tiny_base) -> Path:
    root = tmp_path_factory.mktemp("rayenc")
    for i in range(4):
        make_lora(tiny_base, root / f"e{i}", f"enc{i}", seed=20 + i, version="1")
    make_lora(tiny_base, root / "e0v2", "enc0", seed=40, version="2")
    return root


def ray_settings(tmp: Path, model_dir: Path, index: Path, **kw: Any):
    from qswap.bench.processes import free_port
    from qswap.server.config import ServerSettings
    base = dict(host="127.0.0.1", port=free_port(), model=str(model_dir), index=index, device="cpu",
                state_dir=tmp / "state", batch_window_ms=2.0, log_json=True, admin_token=ADMIN)
    base.update(kw)
    return ServerSettings(**base)


def wait_ready(url: str, replicas: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=10) as c:
        while True:
            try:
                if c.get("/readyz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready")
            time.sleep(0.1)


def replica_stats(state_dir: Path, deployment: str = "ingress", want: int = 2,
                  timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    """Stats of every live replica of ``deployment`` (``ingress`` or ``encoder``), keyed by replica id.

    Read from the files replicas write to ``<state dir>/replicas/`` every 0.5 s, keeping only those
    written after this call: values are current, and a killed replica (it writes no more) drops
    out. A deployment handle would not do: its router may send every call to the same replica.
    Returns once ``want`` replicas have written (or after ``timeout``, with those that did)."""
    from qswap.server.ray.stats import REPLICA_STATS_DIR
    folder = Path(state_dir) / REPLICA_STATS_DIR
    since = time.time()
    deadline = time.monotonic() + timeout
    while True:
        seen: dict[str, dict[str, Any]] = {}
        for f in folder.glob("*.json"):
            try:
                s = json.loads(f.read_text())
            except (OSError, ValueError):   # replaced between listing and reading
                continue
            if s.get("deployment") == deployment and s.get("written_at", 0) >= since:
                seen[s["replica"]] = s
        if len(seen) >= want or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)   # polls the files the replicas write; orders nothing

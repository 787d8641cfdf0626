"""Server test fixtures: a small real index, real encoders, and a real uvicorn server thread."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest

from ..encoders.adapters import make_lora, make_overrides

ADMIN = "admin-token-0123456789abcdef"
SEARCH = "search-token-0123456789abcdef"
SECTIONS = ("games", "sound", "science", "net")
WORDS = ("game games play music sound science math data network server client library tool python "
         "linux debian search index query document encoder chess puzzle physics chemistry audio video text").split()


def make_docs(n: int = 50, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"id": f"d{i:03d}", "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))),
             "section": SECTIONS[i % len(SECTIONS)], "n": i} for i in range(n)]


class LiveServer:
    """uvicorn serving ``create_app(settings)`` on 127.0.0.1 with a free port, in a thread."""

    def __init__(self, settings: Any) -> None:
        import uvicorn

        from qswap.server.http.app import create_app
        self.app = create_app(settings)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        from qswap.server.http.connections import uvicorn_config
        self.server = uvicorn.Server(uvicorn_config(self.app, settings, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, wait_ready: bool = True, timeout: float = 60.0) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("server thread died during start")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.01)
        if wait_ready:
            with httpx.Client(base_url=self.url, timeout=10) as c:
                while True:
                    r = c.get("/readyz")
                    if r.status_code == 200:
                        break
                    err = self.app.state.qs.load_error
                    if err:
                        raise RuntimeError(f"server failed to load: {err}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"server not ready: {r.text}")
                    time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()

    def client(self, token: str | None = None, **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, timeout=30, headers=headers, **kw)

    def __enter__(self) -> "LiveServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def corpus_docs() -> list[dict[str, Any]]:
    return make_docs()


@pytest.fixture(scope="session")
def index_dir(tmp_path_factory: pytest.TempPathFactory, tiny_base, corpus_docs) -> Path:
    """A real qswap index of 50 documents embedded by the tiny base (flat, exact)."""
    from qswap.index import build_index
    d = tmp_path_factory.mktemp("index")
    corpus = d / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in corpus_docs))
    idx = build_index(corpus, d / "idx", tiny_base.encode_documents, tiny_base.space, progress=False)
    idx.close()
    return d / "idx"


@pytest.fixture(scope="session")
def doc_embeddings(tiny_base, corpus_docs) -> np.ndarray:
    return tiny_base.encode_documents([d["text"] for d in corpus_docs])


@pytest.fixture(scope="session")
def encoders_root(tmp_path_factory: pytest.TempPathFactory, tiny_base, other_tiny_model_dir) -> Path:
    """Encoder directories the server may register by path."""
    from qswap.encoders import load_base
    root = tmp_path_factory.mktemp("encroot")
    make_lora(tiny_base, root / "ft1", "ft", seed=11, version="1")
    make_lora(tiny_base, root / "ft2", "ft", seed=12, r=8, targets=("query", "key", "dense"), version="2")
    make_overrides(tiny_base, root / "bias1", "bias", "bias", seed=13)
    make_overrides(tiny_base, root / "part1", "part", "partial", seed=14)
    other = load_base(other_tiny_model_dir, device="cpu")
    make_overrides(other, root / "alien", "alien", "bias", seed=15)
    return root


@pytest.fixture(scope="session")
def reference_pool(tiny_base, encoders_root):
    """An EncoderPool with the same encoders, to compute what the server must answer."""
    from qswap.encoders import EncoderPool, load_encoder
    pool = EncoderPool(tiny_base)
    for d in ("ft1", "ft2", "bias1", "part1"):
        pool.add(load_encoder(encoders_root / d, tiny_base.space))
    return pool


def server_settings(tmp: Path, model_dir: Path, index: Path, **kw: Any):
    from qswap.server.config import ServerSettings
    base = dict(host="127.0.0.1", model=str(model_dir), index=index, device="cpu", state_dir=tmp / "state",
                batch_window_ms=5.0, log_json=True)
    base.update(kw)
    return ServerSettings(**base)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir, index_dir, encoders_root) -> Iterator[LiveServer]:
    """The main server: admin token, open search, small limits to test them."""
    tmp = tmp_path_factory.mktemp("live")
    s = server_settings(tmp, tiny_model_dir, index_dir, encoders_root=encoders_root, admin_token=ADMIN,
                        max_queries=8, max_k=20, max_body_bytes=64 * 1024, max_query_chars=400)
    with LiveServer(s) as srv:
        yield srv


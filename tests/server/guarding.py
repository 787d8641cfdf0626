"""Shared pieces of the guard tests: a small index with sentinels over it, encoder directories
(harmless and over-tuned), a verdict poller, and a gate that holds the guard thread."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import httpx

from qswap.bench.data.encoders import perturbed_encoder
from qswap.encoders import save_encoder

from .conftest import WORDS

N_DOCS = 160


def wait_verdict(srv: Any, c: httpx.Client, key: str, timeout: float = 120.0) -> dict:
    """Wait on the server's own evaluation job of ``key`` (its future, no polling), then read
    the record over HTTP: the verdict is stored before the job ends."""
    srv.app.state.qs.registry.wait_for_guard(key, timeout)
    info = c.get(f"/v1/encoders/{key}").json()
    assert info["guard_status"] != "evaluating", info
    return info


def save_bias(root: Path, folder: str, name: str, version: str, tiny_base: Any, scale: float, seed: int = 3,
              guard: dict | None = None) -> Path:
    """Every bias of the base moved by ``scale`` x noise: 3.0 ruins retrieval, 1e-4 changes nothing."""
    return perturbed_encoder(tiny_base, root / folder, name, kind="bias", scale=scale, seed=seed, version=version,
                             guard=guard)


def build_guard_data(tmp: Path, tiny_base: Any) -> dict[str, Path]:
    """A 160-document index, two sentinels over it (80 judged queries each), encoder directories."""
    from qswap.beir import write_jsonl, write_qrels
    from qswap.index import build_index

    rng = random.Random(7)
    docs = [{"id": f"g{i:03d}", "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 10)))}
            for i in range(N_DOCS)]
    (tmp / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    build_index(tmp / "corpus.jsonl", tmp / "idx", tiny_base.encode_documents, tiny_base.space,
                progress=False).close()
    sent = tmp / "sentinels"
    for s, part in (("alpha", docs[:80]), ("beta", docs[80:])):
        (sent / s / "qrels").mkdir(parents=True)
        # A query is its document's text minus its last word: the base finds most of them.
        write_jsonl(sent / s / "queries.jsonl",
                    [{"_id": f"q{d['id']}", "text": d["text"].rsplit(" ", 1)[0]} for d in part])
        write_qrels(sent / s / "qrels" / "test.tsv", [(f"q{d['id']}", d["id"], 1) for d in part])
    root = tmp / "encroot"
    root.mkdir()
    # Over-tuned: every bias pushed far off (what a too-high learning rate does), yet its
    # manifest claims the tuning guard passed.
    claims = {"passed": True, "checks": []}
    for v in ("1", "2"):
        save_bias(root, f"bad{v}", "bad", v, tiny_base, 3.0, guard=claims)
    # A tiny, harmless change and the identity, both without any guard record.
    save_bias(root, "mild1", "mild", "1", tiny_base, 1e-4, seed=4)
    save_encoder(root / "ident1", name="ident", version="1", kind="identity", space=tiny_base.space)
    return {"tmp": tmp, "index": tmp / "idx", "sentinels": sent, "root": root,
            "alpha_docs": [d["id"] for d in docs[:80]]}


class GuardGate:
    """Holds the server's guard thread at the start of every evaluation until :meth:`open`:
    while it is held, the encoder being registered is deterministically ``evaluating``."""

    def __init__(self, guard: Any) -> None:
        self.guard = guard
        self.entered = threading.Event()
        self._open = threading.Event()
        self._orig = guard.evaluate

    def _evaluate(self, *args: Any, **kw: Any) -> Any:
        self.entered.set()
        assert self._open.wait(120), "the gate was never opened"
        return self._orig(*args, **kw)

    def open(self) -> None:
        self._open.set()

    def __enter__(self) -> "GuardGate":
        self.guard.evaluate = self._evaluate
        return self

    def __exit__(self, *exc: Any) -> None:
        self._open.set()
        del self.guard.evaluate   # the class's method again
